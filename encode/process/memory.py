"""Peak memory of the VAE encoder per image, to size `encoder.batch_size: 0` on the GPU the encode runs on.

`measured_bytes_per_image` runs the real encode call (`Encoders.encode_images`: the model, its precision,
layout and norms as configured) on two small batches of the largest image size and takes the difference of
their peaks: on CUDA the caching allocator's peak, elsewhere `peak_tensor_bytes`, which tracks the bytes of
every tensor an op returns until it is freed (a torch dispatch mode: no allocator).

It is measured, not computed on the host, because the host's count misses what CUDA adds. An earlier
version scaled a CPU count at 128 px (bf16 autocast, 20.0 MiB per image, so 320 MiB at 512 px) and sized
88 images on a 40 GB A100 and 184 on an 80 GB H100. The GPU test list then ran SD2-base's VAE encoder at
512 px, fp16, channels_last, batch 88 on an H200 (torch 2.11): 51.4 GiB allocated at its peak, 579 MiB per
image, 1.8x the count (most likely the NCHW copy CUDA's GroupNorm kernel makes of each fp32 NHWC input,
which the host's kernel reads in place; not profiled). That batch needs 51 GiB on a card with 39.4 GiB, so
every GPU would have failed on out-of-memory at 512 px. At 579 MiB per image `auto_batch` gives 48 on a
40 GB A100, 96 on an 80 GB H100 and 176 on an H200. The GPU test list measures again
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


# Images in the two probe batches: their peaks' difference is what each image adds, without the weights,
# the cuDNN workspace or anything else a batch of any size holds.
PROBE_BATCHES = (2, 4)


def measured_bytes_per_image(encode: Callable[[int], Any], device: torch.device) -> float:
    """Bytes one more image adds to the peak of `encode(n)` (n images through the real encode call) on
    `device`."""
    small, large = PROBE_BATCHES
    return (_peak_bytes(encode, large, device) - _peak_bytes(encode, small, device)) / (large - small)


def _peak_bytes(encode: Callable[[int], Any], images: int, device: torch.device) -> int:
    if device.type != "cuda":
        return peak_tensor_bytes(lambda: encode(images))
    encode(images)  # cuDNN's algorithm search and the allocator's growth, once per shape
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    encode(images)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


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
