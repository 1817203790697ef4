"""Train-step timing and FLOP counting for `make bench` (train/bench/run.py runs these; no YAML here).

Two steps are timed on synthetic inputs of the preset's exact shapes, already on the device (data loading is
measured on its own, in train/bench/data.py):
- offline: what the train job runs per batch on precomputed latents, on the model the train job builds
  (`train.model.assemble.assemble_model`: same class, layout and compilation from the same TrainConfig):
  `DiffusionModel` forward (`Objective.prepare`: the per-sample draws from the batch's seeds, on the
  device) + loss + backward + the job's gradient clipping + optimizer step + EMA update (anatomy's FullStep);
- online: the baseline without precomputing: VAE-encode the pixel batch and run the text tower on token ids,
  then the same step. Tokenizing stays out (an online pipeline does it in its loader workers).

FLOPs are counted with `torch.utils.flop_counter.FlopCounterMode` on models built on the `meta` device: no
memory, no compute, and attention is counted (its math path decomposes into `bmm`). On CPU tensors the
counter misses attention, because PyTorch's CPU flash-attention kernel has no entry in its FLOP registry
(the tiny U-Net at 512 px would read 3.6x low).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from shared.contract import LATENT_LOGVAR, LATENT_MEAN, TEXT_EMBEDDING
from shared.models import build_text_encoder, build_unet, build_vae
from shared.presets import Preset, get_preset, random_init
from shared.runtime.device import DeviceSetup
from train.bench.anatomy.ops import FullStep
from train.bench.anatomy.profile import profile_steps
from train.bench.config import StepBenchConfig
from train.config import TrainConfig
from train.data.draws import SAMPLE_SEED
from train.loop.trainer import build_optimizer
from train.model.assemble import assemble_model, forget_compiled_code
from train.model.diffusion import DiffusionModel
from train.model.kernels import use_gpu_kernel_settings

TERA = 1e12
# Stored posteriors of a real VAE have log-variances around here; only the shape and dtype matter for speed.
SYNTHETIC_LOGVAR = -5.0
SEED_BOUND = 1 << 62  # sample seeds are non-negative 63-bit integers (train/data/loader.py)


def progress(message: str) -> None:
    """A line on stderr as the bench goes: one cold compile of SD2's U-Net took over 200 s on an H200."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Timing:
    """Seconds per call of the timed repeats (warm-up calls excluded)."""

    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def to_json(self) -> dict[str, Any]:
        return {"median_s": self.median, "runs_s": self.seconds}


def time_calls(fn: Callable[[], Any], warmup: int, repeats: int, setup: DeviceSetup) -> Timing:
    """Run `fn` warmup times untimed, then `repeats` times timed (each waits for the device)."""
    return time_interleaved({"fn": fn}, warmup, repeats, setup)["fn"]


# ------------------------------------------------------------------------------------------------ models
def build_diffusion_model(train_cfg: TrainConfig, setup: DeviceSetup) -> DiffusionModel:
    """The train job's model for this device, built by the train job's own code (train/model/assemble.py),
    with an all-zero empty-caption embedding, moved to the device."""
    preset = get_preset(train_cfg.model.preset)
    empty = torch.zeros(preset.text_shape())
    model = assemble_model(train_cfg, setup.kind, preset.scale_factor, empty)
    use_gpu_kernel_settings(setup.kind, train_cfg.attention_backend)  # as train/loop/trainer.py build_model
    return model.to(setup.device)  # keeps the layout assemble_model chose


def build_frozen_encoders(preset: Preset) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(VAE, text tower) as encode builds them; the text tower maps token ids to the SD2 embedding."""
    preset = random_init(preset)
    text = build_text_encoder(preset, "transformers")
    return build_vae(preset), text.model


def place(module: torch.nn.Module, setup: DeviceSetup) -> torch.nn.Module:
    """A frozen encoder (the online baseline's) on the device, NHWC on GPU as encode runs it."""
    module.to(setup.device)
    if setup.channels_last:
        module.to(memory_format=torch.channels_last)
    return module


# ------------------------------------------------------------------------------------------------ inputs
def synthetic_latent_batch(
    preset: Preset,
    resolution: int,
    batch_size: int,
    setup: DeviceSetup,
    seed: int,
    bucket: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """A batch as the loader delivers it (float16 columns, int64 per-sample seeds), moved to the device like
    Composer; at a bucket's (H, W) px of `resolution` if given."""
    gen = torch.Generator().manual_seed(seed)
    channels, height, width = preset.latent_shape(resolution)
    if bucket is not None:  # the VAE downsamples by resolution / height
        height, width = bucket[0] * height // resolution, bucket[1] * width // resolution
    latent = (batch_size, channels, height, width)
    batch = {
        LATENT_MEAN: torch.randn(latent, generator=gen).half(),
        LATENT_LOGVAR: torch.full(latent, SYNTHETIC_LOGVAR).half(),
        TEXT_EMBEDDING: torch.randn((batch_size, *preset.text_shape()), generator=gen).half(),
        SAMPLE_SEED: torch.randint(0, SEED_BOUND, (batch_size,), generator=gen),
    }
    return {name: t.to(setup.device) for name, t in batch.items()}


@dataclass
class PixelBatch:
    """What an online pipeline's loader hands the step: pixels in [-1, 1] and token ids."""

    pixels: torch.Tensor
    token_ids: torch.Tensor
    seeds: dict[str, torch.Tensor]  # {SAMPLE_SEED: ...}, as an online loader's workers would add


def synthetic_pixel_batch(
    preset: Preset,
    resolution: int,
    batch_size: int,
    setup: DeviceSetup,
    seed: int,
) -> PixelBatch:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.rand((batch_size, 3, resolution, resolution), generator=gen) * 2 - 1
    ids = torch.randint(0, int(preset.text["vocab_size"]), (batch_size, preset.text_length), generator=gen)
    latents = synthetic_latent_batch(preset, resolution, batch_size, setup, seed)
    seeds = {SAMPLE_SEED: latents[SAMPLE_SEED]}
    pixels = pixels.to(setup.device)
    if setup.channels_last:
        pixels = pixels.contiguous(memory_format=torch.channels_last)
    return PixelBatch(pixels, ids.to(setup.device), seeds)


# ------------------------------------------------------------------------------------------------ steps
def train_step(
    model: DiffusionModel, optimizer: torch.optim.Optimizer, batch: Any, setup: DeviceSetup
) -> torch.Tensor:
    """One optimizer step as Composer runs it for one microbatch: autocast forward + loss, backward, step."""
    optimizer.zero_grad(set_to_none=True)
    with setup.autocast():
        loss = model.loss(model(batch), batch)
    loss.backward()
    optimizer.step()
    return loss


def encode_on_the_fly(
    vae: torch.nn.Module, text: torch.nn.Module, inputs: PixelBatch, setup: DeviceSetup
) -> dict[str, torch.Tensor]:
    """The online baseline's extra work per batch: VAE posterior of the pixels, text embedding of the ids."""
    with torch.no_grad(), setup.autocast():
        posterior = vae.encode(inputs.pixels).latent_dist
        embedding = text(inputs.token_ids).last_hidden_state
    return {
        LATENT_MEAN: posterior.mean,
        LATENT_LOGVAR: posterior.logvar,
        TEXT_EMBEDDING: embedding,
        **inputs.seeds,
    }


# ------------------------------------------------------------------------------------------------ FLOPs
@dataclass(frozen=True)
class FlopCounts:
    """FLOPs per image (one caption) at one resolution, as counted by FlopCounterMode."""

    resolution: int
    unet_forward: float
    unet_train_step: float  # forward + backward (the optimizer update is not counted: it is per step)
    vae_encoder: float
    text_tower: float
    by_operator: dict[str, dict[str, float]]  # model -> aten op -> FLOPs (where the FLOPs go)

    @property
    def online_train_step(self) -> float:
        return self.unet_train_step + self.vae_encoder + self.text_tower

    @property
    def ideal_offline_speedup(self) -> float:
        """Step FLOPs with on-the-fly encoding / without: the speedup if time followed FLOPs."""
        return self.online_train_step / self.unet_train_step

    def to_json(self) -> dict[str, Any]:
        return {
            "unet_forward": self.unet_forward,
            "unet_train_step": self.unet_train_step,
            "unet_train_over_forward": self.unet_train_step / self.unet_forward,
            "vae_encoder": self.vae_encoder,
            "text_tower": self.text_tower,
            "online_train_step": self.online_train_step,
            "ideal_offline_speedup": self.ideal_offline_speedup,
            "by_operator": self.by_operator,
        }


def _import_model_code() -> None:
    """Import the model libraries before entering a meta-device context: importing torchvision (pulled in
    by open_clip) while torch.device("meta") is active breaks torch._dynamo's initialisation."""
    import diffusers  # noqa: F401
    import open_clip.transformer  # noqa: F401
    import transformers  # noqa: F401


@contextmanager
def counting() -> Iterator[Any]:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as mode:
        yield mode


def _per_op(mode: Any) -> dict[str, float]:
    return {str(op).removeprefix("aten."): float(n) for op, n in mode.get_flop_counts()["Global"].items()}


@dataclass
class MetaModels:
    """The preset's networks with meta tensors: FLOP counting only."""

    preset: Preset
    unet: torch.nn.Module
    vae: torch.nn.Module
    text: torch.nn.Module

    @classmethod
    def build(cls, preset_name: str) -> MetaModels:
        _import_model_code()
        preset = random_init(get_preset(preset_name))
        with torch.device("meta"):
            unet = build_unet(preset)
            vae, text = build_frozen_encoders(preset)
        return cls(preset, unet.train(), vae, text)

    def count(self, resolution: int) -> FlopCounts:
        preset, meta = self.preset, torch.device("meta")
        latents = torch.zeros((1, *preset.latent_shape(resolution)), device=meta)
        context = torch.zeros((1, *preset.text_shape()), device=meta)
        timestep = torch.zeros(1, dtype=torch.long, device=meta)
        with counting() as forward:
            self.unet(latents, timestep, encoder_hidden_states=context)
        with counting() as train:
            pred = self.unet(latents, timestep, encoder_hidden_states=context).sample
            (pred.float() - latents).pow(2).mean().backward()
        pixels = torch.zeros((1, 3, resolution, resolution), device=meta)
        ids = torch.zeros((1, preset.text_length), dtype=torch.long, device=meta)
        with torch.no_grad(), counting() as vae:
            self.vae.encode(pixels)
        with torch.no_grad(), counting() as text:
            self.text(ids)
        return FlopCounts(
            resolution,
            float(forward.get_total_flops()),
            float(train.get_total_flops()),
            float(vae.get_total_flops()),
            float(text.get_total_flops()),
            {"unet_train_step": _per_op(train), "vae_encoder": _per_op(vae), "text_tower": _per_op(text)},
        )


def count_flops(preset_name: str, resolutions: list[int]) -> dict[int, FlopCounts]:
    """FLOPs per image at each resolution for the preset's U-Net, VAE encoder and text tower."""
    models = MetaModels.build(preset_name)
    return {res: models.count(res) for res in resolutions}


def mfu(flops_per_image: float, images_per_s: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the device's peak (None when the peak is unknown)."""
    if not peak_tflops:
        return None
    return flops_per_image * images_per_s / (peak_tflops * TERA)


# ------------------------------------------------------------------------------------------- the benchmark
def time_interleaved(
    calls: dict[str, Callable[[], Any]], warmup: int, repeats: int, setup: DeviceSetup
) -> dict[str, Timing]:
    """Like `time_calls` for several calls, alternating them each repeat: on a shared machine a slow spell
    then hits every variant alike, so their ratio stays meaningful."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    setup.sync()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(max(repeats, 1)):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            setup.sync()
            seconds[name].append(time.perf_counter() - start)
    return {name: Timing(s) for name, s in seconds.items()}


class StepBench:
    """The train job's model and optimizer (and, for the online step, the frozen encoders) on one device."""

    def __init__(self, train_cfg: TrainConfig, setup: DeviceSetup, online: bool):
        self.preset = get_preset(train_cfg.model.preset)
        self.setup = setup
        self.model = build_diffusion_model(train_cfg, setup)
        self.optimizer = build_optimizer(train_cfg, self.model)
        self.clip_norm, self.ema = train_cfg.optimizer.grad_clip_norm, train_cfg.ema.enabled
        self.encoders = None
        if online:
            vae, text = build_frozen_encoders(self.preset)
            self.encoders = (place(vae, setup), place(text, setup))

    def measure(
        self, resolution: int, plan: StepBenchConfig, flops: FlopCounts, peak: float | None, seed: int
    ) -> dict[str, Any]:
        setup, model, optimizer = self.setup, self.model, self.optimizer
        batch_size = plan.batch_for(resolution)
        batch = synthetic_latent_batch(self.preset, resolution, batch_size, setup, seed)
        # The step as the train job runs it (clipping, EMA): MFU's. `core`: without them, in the same run.
        full = FullStep.build(model, optimizer, batch, setup, self.clip_norm, self.ema)
        calls: dict[str, Callable[[], Any]] = {
            "offline": full.run,
            "core": lambda: train_step(model, optimizer, batch, setup),
        }
        if self.encoders is not None:
            inputs = synthetic_pixel_batch(self.preset, resolution, batch_size, setup, seed)
            encoders = self.encoders
            calls["online"] = lambda: full.run(batch=encode_on_the_fly(*encoders, inputs, setup))
        forget_compiled_code()  # each resolution is its own train run, in a process of its own
        if setup.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(setup.device)
        progress(f"train {resolution} px, batch {batch_size}: first step (compiles, autotunes) ...")
        first = time_interleaved(calls, 0, 1, setup)  # compile=true: the U-Net compiles in its first call
        progress(f"train {resolution} px: first step {first['offline'].median:.1f} s; timing {plan.repeats}")
        timings = time_interleaved(calls, max(plan.warmup - 1, 0), plan.repeats, setup)
        prepare = time_calls(lambda: model.objective.prepare(batch), 1, plan.repeats, setup)
        offline = timings["offline"]
        rate = batch_size / offline.median
        entry: dict[str, Any] = {
            "images_per_s_per_device": rate,
            "batch_size": batch_size,
            "step": offline.to_json(),
            "first_step_s": first["offline"].median,  # compile (when on) and cuDNN autotuning included
            "tflops_per_s": flops.unet_train_step * rate / TERA,
            "mfu": mfu(flops.unet_train_step, rate, peak),
            # Objective.prepare: the draws from the batch's seeds and the noising, all on the device
            "prepare": prepare.to_json(),
            "prepare_share_of_step": prepare.median / offline.median,
            "core_step": timings["core"].to_json(),  # without clipping and EMA
            "clipping_and_ema_share": 1 - timings["core"].median / offline.median,
            "ideal_offline_speedup": flops.ideal_offline_speedup,
        }
        if "online" in timings:
            online = timings["online"]
            online_rate = batch_size / online.median
            entry["online"] = {
                "images_per_s_per_device": online_rate,
                "step": online.to_json(),
                "tflops_per_s": flops.online_train_step * online_rate / TERA,
                "mfu": mfu(flops.online_train_step, online_rate, peak),
            }
            # Median of per-repeat ratios: each pair ran back to back, under the same machine load.
            pairs = zip(online.seconds, offline.seconds, strict=True)
            entry["offline_speedup"] = statistics.median(on / off for on, off in pairs)
        if setup.device.type == "cuda":
            entry["peak_memory_gb"] = torch.cuda.max_memory_allocated(setup.device) / 2**30
        if plan.profile_steps:
            entry["profile"] = profile_steps(full, plan.profile_steps)
            if busy := entry["profile"].get("device_seconds_per_step"):
                entry["profile"]["device_busy_share"] = busy / offline.median
        return entry


def bench_train_steps(
    train_cfg: TrainConfig,
    setup: DeviceSetup,
    plan: StepBenchConfig,
    flops: dict[int, FlopCounts],
    peak: float | None,
    seed: int,
) -> dict[str, dict[str, Any]]:
    """Per resolution (string keys, as train/estimate.py reads them): offline and online step throughput."""
    torch.manual_seed(seed)
    bench = StepBench(train_cfg, setup, plan.online)
    results = {}
    for res in plan.resolutions:
        results[str(res)] = bench.measure(res, plan, flops[res], peak, seed)
    return results
