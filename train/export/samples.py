"""Sample grids during training: fixed prompts, EMA weights, classifier-free guidance, DDIM/Euler, VAE decode.

The prompts are encoded once with the text encoder the dataset names (its manifest's EncoderIdentity,
whichever text.store it has); the unconditional embedding is the manifest's `empty_caption_embedding`,
exactly what caption dropout trained on (text.store=tokens computes that same embedding online). The
starting noise is fixed by `samples.seed`, so grids compare over training.

A compiled U-Net renders eagerly (`uncompiled`): grids are not worth a compile of their own shape.

The text tower, its tokenizer and the VAE are loaded when the trainer is built (`preload`), before any
collective: local rank 0 first (a hub id downloads into the node's cache), the other ranks of the node after
it, from that copy. Loading them at the first render (step 5000 of the recipe) would run a download inside
the window the other ranks wait for in a collective (Composer's 300 s timeout).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from composer.core import Callback, Event, State
from composer.core.precision import get_precision_context
from composer.loggers import Logger
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler

from shared.encoders import EncoderIdentity
from shared.launch import control
from shared.models import build_vae
from shared.presets import get_preset
from train.config import SamplesConfig
from train.ema.algorithm import find_ema
from train.model.diffusion import DenoiseInput, scheduler_kwargs

log = logging.getLogger(__name__)

Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def inference_scheduler(kind: str, model_cfg: Any) -> Any:
    """DDIM or Euler with the training noise schedule (SD2-base settings: no clipping, final alpha not 1)."""
    from diffusers import DDIMScheduler, EulerDiscreteScheduler

    kwargs = scheduler_kwargs(model_cfg)
    if kind == "ddim":
        return DDIMScheduler(**kwargs, clip_sample=False, set_alpha_to_one=False)
    if kind == "euler":
        return EulerDiscreteScheduler(**kwargs)
    raise ValueError(f"unknown sampler {kind!r}; use ddim or euler")


@torch.no_grad()
def sample_latents(
    denoise: Denoiser,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    scheduler: Any,
    steps: int,
    guidance_scale: float,
    latent_shape: tuple[int, int, int],
    generator: torch.Generator,
) -> torch.Tensor:
    """Classifier-free-guided sampling of len(cond) latents (starting noise drawn on CPU from `generator`)."""
    device = cond.device
    scheduler.set_timesteps(steps)
    batch = cond.shape[0]
    latents = torch.randn((batch, *latent_shape), generator=generator).to(device) * scheduler.init_noise_sigma
    text = torch.cat([uncond.expand(batch, -1, -1), cond])
    for t in scheduler.timesteps:
        model_in = scheduler.scale_model_input(torch.cat([latents, latents]), t)
        timesteps = torch.full((2 * batch,), int(t), device=device, dtype=torch.long)
        pred_uncond, pred_cond = denoise(model_in, timesteps, text).float().chunk(2)
        guided = pred_uncond + guidance_scale * (pred_cond - pred_uncond)
        latents = scheduler.step(guided, t, latents).prev_sample
    return latents


@torch.no_grad()
def decode_images(vae: Any, latents: torch.Tensor, scale_factor: float) -> torch.Tensor:
    """Latents -> uint8 images [B, 3, H, W] (undoing the training scale factor)."""
    images = vae.decode(latents.to(vae.dtype) / scale_factor).sample
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()


def save_grid(
    images: torch.Tensor, path: str, columns: int, labels: Sequence[str] = (), title: str = ""
) -> None:
    """A PNG grid, one row per prompt; `labels[i]` is written above row i and `title` (step, guidance,
    sampler) across the top, so a grid read alone says what it shows."""
    from PIL import Image, ImageDraw

    count, _, height, width = images.shape
    rows = (count + columns - 1) // columns
    font = _label_font()
    line = _text_height(font) + 2 * LABEL_PAD
    grid_width = columns * width
    title_lines = _wrap(title, font, grid_width)
    row_lines = [_wrap(labels[r] if r < len(labels) else "", font, grid_width) for r in range(rows)]
    top = len(title_lines) * line
    offsets = [top + sum(len(lines) * line + height for lines in row_lines[:r]) for r in range(rows + 1)]
    grid = Image.new("RGB", (grid_width, offsets[-1]), LABEL_BACKGROUND)
    draw = ImageDraw.Draw(grid)
    draw.rectangle((0, 0, grid_width, top), fill=TITLE_BACKGROUND)
    for i, text in enumerate(title_lines):
        draw.text((LABEL_PAD, i * line + LABEL_PAD), text, fill=LABEL_COLOUR, font=font)
    for r, lines in enumerate(row_lines):
        for i, text in enumerate(lines):
            draw.text((LABEL_PAD, offsets[r] + i * line + LABEL_PAD), text, fill=LABEL_COLOUR, font=font)
    for i, image in enumerate(images):
        row = i // columns
        tile = Image.fromarray(image.permute(1, 2, 0).numpy())
        grid.paste(tile, ((i % columns) * width, offsets[row] + len(row_lines[row]) * line))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    grid.save(path)


LABEL_PAD = 2  # px around each line of label text
LABEL_BACKGROUND, LABEL_COLOUR, TITLE_BACKGROUND = (255, 255, 255), (0, 0, 0), (220, 220, 220)


def _label_font() -> Any:
    from PIL import ImageFont

    return ImageFont.load_default()  # Pillow's bundled font: no font file needed on any machine


def _text_height(font: Any) -> int:
    _, top, _, bottom = font.getbbox("Ag")
    return int(bottom - top) + 2


def _wrap(text: str, font: Any, width: int) -> list[str]:
    """Greedy word wrap to `width` px (a word longer than a line gets a line of its own)."""
    lines: list[str] = []
    for word in text.split():
        candidate = f"{lines[-1]} {word}" if lines else word
        if lines and font.getlength(candidate) + 2 * LABEL_PAD <= width:
            lines[-1] = candidate
        else:
            lines.append(word)
    return lines


class SampleRenderer(Callback):
    """Every `samples.interval` (and at the end), render the fixed prompts with the EMA weights."""

    def __init__(
        self,
        cfg: SamplesConfig,
        model_cfg: Any,
        encoder: EncoderIdentity,
        empty_caption: torch.Tensor,
        latent_shape: tuple[int, int, int],
        scale_factor: float,
        out_dir: str,
        bucket_shapes: dict[str, tuple[int, int, int]] | None = None,
    ):
        """`bucket_shapes`: "HxW" -> latent shape of the non-square buckets to render too (bucketed data:
        one landscape and one portrait, train/data/buckets.py `sample_buckets`), one grid file each."""
        self.cfg = cfg
        self.bucket_shapes = dict(bucket_shapes or {})
        self.model_cfg = model_cfg
        self.encoder = encoder
        self.empty_caption = empty_caption.to(torch.float32)
        self.latent_shape = latent_shape
        self.scale_factor = scale_factor
        self.out_dir = out_dir
        self.due = create_interval_scheduler(cfg.interval, include_end_of_training=True)
        self.vae: Any = None
        self.prompt_embeddings: torch.Tensor | None = None
        self.last_rendered = -1  # the last batch of training is both an interval hit and the end

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._maybe_render(state, Event.BATCH_CHECKPOINT)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._maybe_render(state, Event.EPOCH_CHECKPOINT)

    def _maybe_render(self, state: State, event: Event) -> None:
        batch = int(state.timestamp.batch)
        if batch != self.last_rendered and self.due(state, event):
            self.last_rendered = batch
            self.render(state)

    def preload(self) -> None:
        """Build the VAE and encode the prompts now, on the host (the text encoder is dropped afterwards);
        local rank 0 first, then the node's other ranks (module doc). Never inside a collective window."""
        with local_rank_zero_first(self.marker_dir()):
            preset = get_preset(self.model_cfg.preset)
            text = self.encoder.build_text_encoder()
            prompts = [p for p in self.cfg.prompts for _ in range(self.cfg.images_per_prompt)]
            self.prompt_embeddings = text.encode(prompts)
            self.vae = build_vae(preset, self.encoder.pretrained)

    def marker_dir(self) -> str:
        """Where local rank 0 says it has loaded: the supervisor's control folder (node-local, removed with
        it), else the samples folder; either way removed at close. In the samples folder every launch left
        one (`.loaded-<host>-<pid>`, mirrored to S3 too: 22 after 21 restarts)."""
        folder = control.control_dir()
        return str(folder) if folder is not None else self.out_dir

    def post_close(self) -> None:
        if dist.get_local_rank() == 0:  # every rank of the node has long passed its preload
            with contextlib.suppress(OSError):
                os.unlink(loaded_marker(self.marker_dir()))

    def render(self, state: State) -> None:
        """Sample on every rank (an FSDP forward is collective); rank 0 writes the grid."""
        device = next(state.model.parameters()).device
        if self.prompt_embeddings is None:
            self.preload()  # a renderer built outside the trainer (build_callbacks preloads)
        assert self.prompt_embeddings is not None
        self.prompt_embeddings = self.prompt_embeddings.to(device)  # a device copy, once
        self.vae = self.vae.to(device)
        # The square grid keeps its name; each bucket's grid is named by its pixel shape (ba<step>-HxW.png).
        shapes = {"": self.latent_shape, **{f"-{name}": s for name, s in self.bucket_shapes.items()}}
        for suffix, shape in shapes.items():
            with use_ema_weights(state), get_precision_context(state.precision), uncompiled():
                was_training = state.model.training
                state.model.eval()
                try:
                    latents = self._sample(state, device, shape)
                finally:
                    state.model.train(was_training)
            self._write(state, decode_images(self.vae, latents.float(), self.scale_factor), suffix)

    def _write(self, state: State, images: torch.Tensor, suffix: str) -> None:
        if dist.get_global_rank() == 0:
            path = os.path.join(self.out_dir, f"ba{int(state.timestamp.batch):08d}{suffix}.png")
            caption = (
                f"step {int(state.timestamp.batch)}, guidance {self.cfg.guidance_scale:g}, {self.cfg.sampler}"
            )
            if suffix:
                caption += f", {suffix[1:]} px"
            save_grid(
                images,
                path,
                self.cfg.images_per_prompt,
                self.cfg.prompts,
                f"{caption} {self.cfg.steps} steps",
            )
            log.info("wrote sample grid %s", path)

    def _sample(self, state: State, device: torch.device, shape: tuple[int, int, int]) -> torch.Tensor:
        assert self.prompt_embeddings is not None

        def denoise(x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
            return state.model(DenoiseInput(x, t, text))

        return sample_latents(
            denoise,
            self.prompt_embeddings,
            self.empty_caption.to(device)[None],
            inference_scheduler(self.cfg.sampler, self.model_cfg),
            self.cfg.steps,
            self.cfg.guidance_scale,
            shape,
            torch.Generator().manual_seed(self.cfg.seed),
        )


def uncompiled() -> contextlib.AbstractContextManager[Any]:
    """The U-Net called eagerly inside: a grid calls it in eval mode at its own batch and shape, where a
    compiled U-Net (static shapes) would compile another graph (minutes for SD2 on a cold cache, and under
    compile_mode=reduce-overhead another captured graph and its memory) to save a few seconds of eager
    calls every few thousand steps."""
    return torch.compiler.set_stance("force_eager")


LOADED_MARKER = ".loaded-{host}-{launch}"  # one per node and per launch: ranks of a new launch never see it
LOAD_WAIT_S = 3600.0  # a hub download of SD2's text tower and VAE (~1.7 GB) over a slow link


def loaded_marker(marker_dir: str) -> str:
    return os.path.join(marker_dir, LOADED_MARKER.format(host=socket.gethostname(), launch=os.getppid()))


@contextlib.contextmanager
def local_rank_zero_first(marker_dir: str, timeout_s: float = LOAD_WAIT_S) -> Iterator[None]:
    """Local rank 0 runs the body first and then writes a marker; the node's other ranks wait for the
    marker (polling a file, no collective and so no collective timeout) and then run the body, which finds
    rank 0's local copy. The marker is named by the host and the launcher's pid (the ranks' common parent
    under torchrun and Composer's launcher), so one left by an earlier launch is never taken for this one."""
    marker = loaded_marker(marker_dir)
    if dist.get_local_rank() != 0:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(marker):
            if time.monotonic() > deadline:
                raise TimeoutError(f"local rank 0 did not finish loading in {timeout_s:.0f} s ({marker})")
            time.sleep(0.2)
        yield
        return
    yield
    os.makedirs(marker_dir, exist_ok=True)
    with open(marker, "w") as f:
        f.write("loaded\n")


class use_ema_weights:
    """Swap the EMA weights into the model for the duration (a no-op without EMA or before it starts)."""

    def __init__(self, state: State):
        self.state = state
        self.ema = find_ema(state.algorithms)
        self.swapped = False

    def __enter__(self) -> None:
        ema = self.ema
        if ema is not None and ema.ema_model is not None and ema.ema_started and not ema.ema_weights_active:
            ema.ema_model.swap_params(self.state.model)
            self.swapped = True

    def __exit__(self, *exc: object) -> None:
        if self.swapped and self.ema is not None and self.ema.ema_model is not None:
            self.ema.ema_model.swap_params(self.state.model)
