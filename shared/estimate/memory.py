"""The batch per GPU from the GPU's memory (instead of a fixed A100-era value): what stays resident per
parameter, what one image's activations take, and how many images fit beside it.

Resident bytes per parameter for this job (fp32 master weights, AdamW with two moments, an EMA copy):

    without FSDP (one GPU, DDP):  weights 4 + grads 4 + AdamW 8 + EMA 4                     = 20 B
    FSDP SHARD_GRAD_OP on W ranks: (4 + 4 + 8 + 4) / W + 2 (bf16 params gathered for the
                                   whole forward and backward)                              = 20 / W + 2 B
    FSDP FULL_SHARD on W ranks:   (4 + 4 + 8 + 4) / W (one block gathered at a time)        = 20 / W B

Activations per image are measured (`make bench`'s anatomy section: bytes saved for backward at batch b
and 2b, the difference over b), so they follow the precision, attention kernel and switches of the run.
A fixed share of memory is kept back for the allocator's fragmentation, cuDNN / cuBLAS workspaces,
gradient buckets and the transient tensors of backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Strategy = Literal["DDP", "SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD"]
STATE_BYTES_PER_PARAM = 4 + 4 + 8 + 4  # fp32 weights, fp32 grads, AdamW exp_avg + exp_avg_sq, EMA
GATHERED_PARAM_BYTES = 2  # bf16 params FSDP keeps gathered between forward and backward (SHARD_GRAD_OP)
USABLE_SHARE = 0.85  # of device memory: the rest for fragmentation, workspaces and backward's transients


def resident_bytes(params: int, world_size: int = 1, strategy: Strategy = "DDP") -> float:
    """Bytes per GPU that do not depend on the batch (module doc)."""
    if strategy in ("DDP", "NO_SHARD") or world_size <= 1:
        return float(STATE_BYTES_PER_PARAM * params)
    sharded = STATE_BYTES_PER_PARAM * params / world_size
    return sharded + (GATHERED_PARAM_BYTES * params if strategy == "SHARD_GRAD_OP" else 0.0)


@dataclass(frozen=True)
class BatchFit:
    """The largest batch per GPU that fits, and the power of two at or below it (what a recipe would pick:
    it divides the usual global batches)."""

    max_images: int
    power_of_two: int
    resident_gb: float
    activation_gb_per_image: float
    usable_gb: float

    def to_json(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def batch_that_fits(
    memory_gb: float,
    activation_bytes_per_image: float,
    params: int,
    world_size: int = 1,
    strategy: Strategy = "DDP",
    usable_share: float = USABLE_SHARE,
) -> BatchFit:
    """Images per GPU that fit in `memory_gb` (GB = 1e9 bytes) next to the resident state (module doc)."""
    if activation_bytes_per_image <= 0:
        raise ValueError(f"activation bytes per image must be > 0, got {activation_bytes_per_image}")
    usable = memory_gb * 1e9 * usable_share
    resident = resident_bytes(params, world_size, strategy)
    images = max(0, int((usable - resident) // activation_bytes_per_image))
    power = 1 << (images.bit_length() - 1) if images else 0
    return BatchFit(images, power, resident / 1e9, activation_bytes_per_image / 1e9, usable / 1e9)
