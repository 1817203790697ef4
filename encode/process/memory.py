"""Computed peak memory of the VAE encoder per image, to size `encoder.batch_size` for a GPU without one.

`peak_tensor_bytes` tracks the bytes of every tensor an op returns until the tensor is freed (a torch
dispatch mode: no GPU, no allocator), and returns the high-water mark. `vae_encode_peak_per_image` runs the
preset's VAE encoder at a small resolution under bf16 autocast (2 bytes a value like the fp16 that encode
runs on GPU; group norms stay in fp32 under both) and scales by the pixel count: every activation of the
encoder's convolutions and norms grows with H x W. Its mid-block attention does not, but on a GPU it runs
as memory-efficient SDPA and never holds the token x token matrix.

SD2-base's VAE, computed as encode holds it: 20.0 MiB per image at 128 px under bf16 autocast, so 320 MiB
per image at 512 px; with the VAE (335 MB) and text tower (1.4 GB) in fp32 beside it, batch 88 needs
29.1 GiB and batch 128 41.6 GiB. (An earlier count, 33.8 / 540 MiB, ran a VAE whose weights required grad:
autocast then caches a bf16 copy of each weight for the whole region, which encode's frozen VAE never
holds, and the scaling by pixels multiplied those copies too. The autocast cache is off here, so the count
does not depend on the caller's requires_grad.) `encoder.batch_size: 0` (what jobs/datasets/laion400m.yaml
ships) sizes the batch on the GPU it runs on (`auto_batch`, BATCH_HEADROOM of its memory): 88 on a 40 GB
A100, 184 on an 80 GB H100 at 512 px. The GPU test list measures the real peak at the 40 GB A100's batch
(tests/encode/test_gpu_encode.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

A100_40GB_USABLE = 39.4 * 2**30  # what torch reports as total on an A100-SXM4-40GB (40 GiB less reserved)
BATCH_HEADROOM = 0.75  # of the usable memory: allocator fragmentation, cuDNN workspaces, the writer's queue
# Past a few hundred images a batch no longer runs the VAE faster, and each partition's short last batch
# and the batches queued ahead (encode/pipeline.py) grow with it.
AUTO_BATCH_CAP = 256
CPU_AUTO_BATCH = 32  # `encoder.batch_size: 0` off a GPU: host memory is not what bounds it


class PeakTensorBytes(TorchDispatchMode):
    """The most bytes that op outputs held at once (views of a live tensor are not counted twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    weakref.finalize(value, self._free, key)
        self.peak = max(self.peak, self.now)
        return out


def peak_tensor_bytes(fn: Callable[[], Any]) -> int:
    with PeakTensorBytes() as tracker:
        fn()
    return tracker.peak


def vae_encode_peak_per_image(vae: Any, resolution: float, at: int = 128, batch: int = 2) -> float:
    """Bytes of activations per image for the VAE encoder at `resolution` (the side of a square with the
    image's pixel count), from a run at `at` px."""
    pixels = torch.randn(batch, 3, at, at)

    def encode() -> None:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            vae.encode(pixels).latent_dist.mean  # noqa: B018  (the encoder's output, as encode reads it)

    return peak_tensor_bytes(encode) / batch * (resolution / at) ** 2


def weights_bytes(*modules: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def largest_batch(per_image: float, fixed: float, usable: float = A100_40GB_USABLE) -> int:
    """The largest batch whose computed peak stays within BATCH_HEADROOM of `usable`."""
    return int((usable * BATCH_HEADROOM - fixed) // per_image)


def auto_batch(per_image: float, fixed: float, usable: float) -> int:
    """`encoder.batch_size: 0` on a GPU: the largest batch within BATCH_HEADROOM of `usable`, rounded down
    to a multiple of 8 (whole tensor-core tiles) and at most AUTO_BATCH_CAP; at least 1."""
    fits = largest_batch(per_image, fixed, usable)
    return max(1, min(AUTO_BATCH_CAP, fits - fits % 8 if fits >= 8 else fits))


def text_tower_params(text: dict[str, int]) -> int:
    """Parameters of a CLIP text transformer from its preset dict: per layer attention (4 w^2 + 4 w), MLP
    (8 w^2 + 5 w) and two layer norms (4 w), plus token and position embeddings and the final norm."""
    width, layers = text["width"], text["layers"]
    per_layer = 12 * width * width + 13 * width
    return layers * per_layer + (text["vocab_size"] + text["context_length"]) * width + 2 * width
