"""The frozen encoders used by encode: VAE and text tower on the chosen device, batched inference.

With text.store=tokens the text side stores the tokenizer's ids (uint16) instead of running the tower;
the tower is still loaded, because the manifest records its weights hash and the empty-caption embedding.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from encode.config import EncodeConfig
from encode.plan.fingerprints import EncoderIds
from encode.process.images import UINT8_MAX
from encode.process.memory import (
    BATCH_HEADROOM,
    CPU_AUTO_BATCH,
    auto_batch,
    measured_bytes_per_image,
    weights_bytes,
)
from shared import contract
from shared.encoders import TOKENS, EncoderIdentity
from shared.models import TextEncoder, build_text_encoder, build_vae, weights_fingerprint
from shared.norms import use_low_precision_norms
from shared.presets import Preset, get_preset
from shared.runtime.device import autocast, check_node_sees_gpu, nodes_in_launch, pick_torch_device

log = logging.getLogger("encode")


def tokenizer_fingerprint(text: TextEncoder) -> str:
    vocab = text.tokenizer.get_vocab() if hasattr(text.tokenizer, "get_vocab") else text.tokenizer.encoder
    blob = json.dumps(sorted(vocab.items()), separators=(",", ":")).encode()
    return f"{text.backend}:{hashlib.sha256(blob).hexdigest()}"


def host_pixel_batch(pixels: Sequence[np.ndarray], pin: bool) -> torch.Tensor:
    """uint8 HWC images of one size -> one uint8 NHWC tensor, in page-locked memory when `pin` (a CUDA
    copy from pinned memory runs asynchronously; from pageable memory it is staged and synchronous)."""
    if not pixels:
        raise ValueError("host_pixel_batch needs at least one image")
    for p in pixels:
        if p.ndim != 3 or p.shape[2] != 3 or p.dtype != np.uint8 or p.shape != pixels[0].shape:
            raise ValueError(f"expected uint8 HxWx3 RGB pixels of one size, got {p.dtype} {p.shape}")
    batch = torch.empty((len(pixels), *pixels[0].shape), dtype=torch.uint8, pin_memory=pin)
    np.stack(pixels, out=batch.numpy())
    return batch


def pixels_to_vae_input(batch: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 NHWC -> NCHW in [-1, 1] in `dtype` (the VAE's), what the SD VAE encoder expects.

    Same arithmetic as `encode.process.images.to_model_input` (x / 127.5 - 1). The NCHW view of NHWC data is
    channels_last, which cuDNN convolutions prefer; on CPU the batch is made contiguous NCHW, the layout
    the CPU kernels were validated with.
    """
    nchw = batch.permute(0, 3, 1, 2).to(dtype).div_(UINT8_MAX / 2.0).sub_(1.0)
    return nchw if batch.device.type == "cuda" else nchw.contiguous()


class HostArrays:
    """Model outputs on their way to the host as numpy arrays.

    On CUDA the copies are queued into page-locked memory behind the work that makes them, and an event marks
    their end: the host goes on queueing the next batch and waits (`arrays`) only when it needs the values.
    A plain `.cpu()` would wait for the whole device queue at every batch, leaving the device idle while the
    host receives samples and writes rows. Elsewhere the values are already computed.
    """

    def __init__(self, tensors: Sequence[torch.Tensor | np.ndarray]):
        self.event: torch.cuda.Event | None = None
        self.host = list(tensors)
        if any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors):
            self.host = [_pinned_copy(t) for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()

    @classmethod
    def ready(cls, *arrays: np.ndarray) -> HostArrays:
        return cls(arrays)

    def arrays(self) -> list[np.ndarray]:
        if self.event is not None:
            self.event.synchronize()  # this batch's copies only, not what was queued after them
        return [t if isinstance(t, np.ndarray) else t.numpy() for t in self.host]


def _pinned_copy(tensor: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """A device tensor's copy into page-locked host memory, queued on the current stream."""
    if isinstance(tensor, np.ndarray):
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


@dataclass
class Encoders:
    preset: Preset
    vae: Any
    text: TextEncoder
    device: torch.device
    precision: str
    ids: EncoderIds
    # How many captions / images went through each model in this process (tests and metrics read these).
    texts_encoded: int = 0
    images_encoded: int = 0
    halved_batches: int = 0  # batches split in two after running out of GPU memory (`_posterior`)
    batch_size: int = CPU_AUTO_BATCH  # what `encoder.batch_size: 0` resolved to (load_encoders)
    # The shapes the VAE ran on (padding included), each with its batch count: under cuDNN autotuning every
    # new shape times each convolution's algorithms again (make bench's encode section reports them).
    vae_input_shapes: dict[tuple[int, ...], int] = field(default_factory=dict)

    def shapes(self, resolution: int, store: str = "embeddings") -> contract.Shapes:
        return contract.Shapes(self.preset.latent_shape(resolution), self.preset.text_shape(), store)

    def _autocast(self) -> Any:
        return autocast(self.device, self.precision)  # CPU: fp32 (shared/runtime/device.py says why)

    def encode_text(self, captions: Sequence[str], store: str = "embeddings") -> np.ndarray:
        """What text.store keeps per caption: embeddings [B, L, D] float32, or token ids [B, L] uint16."""
        return self.launch_text(captions, store).arrays()[0]

    def launch_text(self, captions: Sequence[str], store: str = "embeddings") -> HostArrays:
        """`encode_text` queued on the device; the host waits only in `.arrays()`."""
        self.texts_encoded += len(captions)
        if store == TOKENS:
            return HostArrays.ready(self.tokenize(captions))
        with self._autocast():
            return HostArrays([self.text.encode(list(captions)).float()])

    def tokenize(self, captions: Sequence[str]) -> np.ndarray:
        ids = self.text.tokenize(list(captions)).cpu().numpy()
        return contract.text_cell(ids)[contract.TEXT_TOKENS]  # refuses ids outside uint16

    def empty_caption_tokens(self) -> np.ndarray:
        """The empty caption's ids: train swaps them in for caption dropout with text.store=tokens."""
        return self.tokenize([""])[0]

    def identity(self, cfg: EncodeConfig) -> EncoderIdentity:
        """What the manifest records about these encoders (shared/encoders.py)."""
        enc = cfg.encoder
        return EncoderIdentity(
            preset=cfg.preset,
            pretrained=enc.pretrained,
            text_backend=enc.text_backend,
            open_clip_checkpoint=enc.open_clip_checkpoint,
            vae_hash=self.ids.vae,
            text_hash=self.ids.text,
            tokenizer_hash=self.ids.tokenizer,
            text_store=cfg.text.store,
        )

    def encode_images(self, pixels: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """uint8 HWC images of one size -> unscaled posterior (mean, logvar), float32.

        The batch crosses to the device as uint8 (a quarter of float32's bytes: 100 MB instead of 400 MB
        for 128 x 512 px) and becomes [-1, 1] floats there.
        """
        mean, logvar = self.launch_images(pixels).arrays()
        return mean, logvar

    def launch_images(self, pixels: Sequence[np.ndarray]) -> HostArrays:
        """`encode_images` queued on the device: (mean, logvar) once `.arrays()` returns."""
        return self.launch_vae(self.pixel_batch(pixels))

    def pixel_batch(self, pixels: Sequence[np.ndarray]) -> torch.Tensor:
        """The host side of `launch_images`: one uint8 NHWC batch, pinned when the VAE is on a GPU."""
        return host_pixel_batch(pixels, pin=self.device.type == "cuda")

    def launch_vae(self, host: torch.Tensor) -> HostArrays:
        """The device side of `launch_images`, from `pixel_batch`'s batch."""
        self.images_encoded += len(host)
        with torch.inference_mode(), self._autocast():
            return HostArrays(list(self._posterior(host.to(self.device, non_blocking=True))))

    def _padded_posterior(self, pixels: torch.Tensor, pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A compiled encoder has one static graph per image size at `batch_size`: a short batch (a
        partition's last) runs padded with blank images (`pad`) instead of compiling a graph of its own."""
        images = len(pixels)
        short = self.batch_size - images
        if pad and short > 0 and self.vae.encoder._compiled_call_impl is not None:
            pixels = torch.cat([pixels, pixels.new_zeros((short, *pixels.shape[1:]))])
        shape = tuple(pixels.shape)
        self.vae_input_shapes[shape] = self.vae_input_shapes.get(shape, 0) + 1
        dist = self.vae.encode(pixels_to_vae_input(pixels, self.vae.dtype)).latent_dist
        return dist.mean[:images].float(), dist.logvar[:images].float()

    def _posterior(self, pixels: torch.Tensor, pad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, logvar) in float32 of uint8 NHWC `pixels` on the device. A batch the GPU has no memory for
        (another process on it, a cuDNN workspace the sizing did not see) runs as two halves, so a long
        encode slows down instead of failing; the log says so once, naming encoder.batch_size."""
        try:
            return self._padded_posterior(pixels, pad)
        except torch.OutOfMemoryError:
            if len(pixels) == 1:
                raise
        # Outside the except block: its traceback would keep the failed batch's tensors alive.
        torch.cuda.empty_cache()
        if not self.halved_batches:
            log.warning(
                "out of GPU memory on a batch of %d images: encoding it in halves; set encoder.batch_size "
                "below %d if this repeats (encoder.batch_size: 0 measures at start what fits)",
                len(pixels), len(pixels),
            )  # fmt: skip
        self.halved_batches += 1
        half = len(pixels) // 2
        # unpadded: padding a half back to the full batch would run out of memory again
        first, second = self._posterior(pixels[:half], False), self._posterior(pixels[half:], False)
        return torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]])

    def empty_caption_embedding(self) -> np.ndarray:
        """The embedding train swaps in for caption dropout (classifier-free guidance)."""
        with self._autocast():
            return self.text.encode([""]).float().cpu().numpy()[0].astype(contract.TEXT_DTYPE)


def pick_encode_device(cfg: EncodeConfig) -> torch.device:
    """`encoder.device` on this rank. A node of a job on several whose GPUs are not seen would encode its
    share on the CPU, for days, while every other rank waits for it at the end: refused (DeviceError) before
    anything is claimed or loaded, naming both fixes."""
    device = pick_torch_device(cfg.encoder.device)
    kind = "gpu" if device.type == "cuda" else "cpu"
    check_node_sees_gpu(cfg.encoder.device, kind, nodes_in_launch(), flag="encoder.device=")
    return device


def load_encoders(cfg: EncodeConfig) -> Encoders:
    preset = get_preset(cfg.preset)
    device = pick_encode_device(cfg)
    vae = build_vae(preset, cfg.encoder.pretrained)
    text = build_text_encoder(
        preset, cfg.encoder.text_backend, cfg.encoder.pretrained, cfg.encoder.open_clip_checkpoint
    )
    # Fingerprint on CPU in fp32 before moving, so the identity does not depend on the device.
    ids = EncoderIds(
        vae=weights_fingerprint(vae), text=text.fingerprint(), tokenizer=tokenizer_fingerprint(text)
    )
    vae.to(device)
    if device.type == "cuda":
        vae.to(memory_format=torch.channels_last)
    text.to(device)
    encoders = apply_encoder_switches(Encoders(preset, vae, text, device, cfg.encoder.precision, ids), cfg)
    use_encode_kernel_settings(cfg.encoder.compile, device)
    return encoders


def apply_encoder_switches(encoders: Encoders, cfg: EncodeConfig) -> Encoders:
    """`cfg.encoder`'s norms, batch (0: measured on this GPU, with the norms swapped) and compile, in that
    order (`make bench` applies them to its random-init encoders the same way)."""
    speed_up_vae(encoders.vae, cfg.encoder.low_precision_norms, compile=False)
    encoders.batch_size = cfg.encoder.batch_size or batch_from_memory(encoders, largest_image_size(cfg))
    if cfg.encoder.compile:  # after the probe's batches: no graph for those
        compile_vae_encoder(encoders.vae, len(image_sizes(cfg)))
    return encoders


def use_encode_kernel_settings(compiled: bool, device: torch.device) -> None:
    """cuDNN autotuning (`cudnn.benchmark`) times each convolution's algorithms once per input shape. A
    compiled encoder meets one shape per image size (short batches are padded): tuned once, kept for the run.
    Eager batches come in every length a partition's filters leave, each tuned anew: on the H200 the encode
    pipeline ran its VAE at half its speed alone with autotuning left on by the bench's train sections."""
    torch.backends.cudnn.benchmark = compiled and device.type == "cuda"


@contextlib.contextmanager
def encode_kernel_settings(compiled: bool, device: torch.device) -> Iterator[None]:
    """`use_encode_kernel_settings` for a block (the bench runs encode in a train process), then restored."""
    before = torch.backends.cudnn.benchmark
    use_encode_kernel_settings(compiled, device)
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def image_sizes(cfg: EncodeConfig) -> set[tuple[int, int]]:
    """(H, W) px of every image size the VAE meets: each resolution's square or its buckets."""
    buckets = cfg.transform.bucket_lists(cfg.filter.max_aspect_ratio)
    return {size for r in cfg.transform.resolutions for size in buckets.get(r) or [(r, r)]}


def largest_image_size(cfg: EncodeConfig) -> tuple[int, int]:
    """(H, W) px of the largest image the VAE meets: the largest resolution's square or bucket."""
    return max(image_sizes(cfg), key=lambda size: size[0] * size[1])


def batch_from_memory(encoders: Encoders, size: tuple[int, int]) -> int:
    """`encoder.batch_size: 0`: the batch this GPU's memory holds beside both models' weights, from the
    bytes one image of `size` (H, W) adds to the real encode call's peak, measured on this GPU."""
    device = encoders.device
    if device.type != "cuda":
        log.info("encoder.batch_size=0: %d per batch (not on a GPU)", CPU_AUTO_BATCH)
        return CPU_AUTO_BATCH
    blank = np.zeros((*size, 3), dtype=np.uint8)
    per_image = measured_bytes_per_image(lambda n: encoders.encode_images([blank] * n), device)
    encoders.images_encoded = 0  # the probe's images are not the run's
    fixed = weights_bytes(encoders.vae, encoders.text.model)
    total = torch.cuda.get_device_properties(device).total_memory
    batch = auto_batch(per_image, fixed, total)
    log.info(
        "encoder.batch_size=0: %d per batch on %s (%.0f MiB per image at %dx%d px, measured; %.1f GB of "
        "weights; %.0f%% of %.1f GiB)",
        batch, torch.cuda.get_device_name(device), per_image / 2**20, *size, fixed / 1e9,
        100 * BATCH_HEADROOM, total / 2**30,
    )  # fmt: skip
    return batch


def speed_up_vae(vae: Any, low_precision_norms: bool, compile: bool) -> None:
    """encoder.low_precision_norms and encoder.compile, in place (after the weights are fingerprinted: the
    swap keeps every parameter, and the manifest's VAE hash does not depend on either switch)."""
    if low_precision_norms:
        use_low_precision_norms(vae)
    if compile:
        compile_vae_encoder(vae)


def compile_vae_encoder(vae: Any, image_sizes: int = 1, backend: Any = "inductor") -> None:
    """encoder.compile: static shapes, one graph per image size (`image_sizes` of them; `Encoders` pads a
    short batch to the full one). By default dynamo recompiles the second size it meets with symbolic height
    and width, as the H200 bench did at 512 px after 256 px, and every short last batch of a partition with
    a symbolic batch."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, image_sizes)
    vae.encoder.compile(backend=backend, dynamic=False)
