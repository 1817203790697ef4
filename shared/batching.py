"""Global batch -> per-rank batch and gradient accumulation, derived once (never hand-computed in configs)."""

from __future__ import annotations

from dataclasses import dataclass


class BatchingError(ValueError):
    """The requested global batch cannot be split evenly over the ranks and microbatches."""


@dataclass(frozen=True)
class Batching:
    global_batch: int
    world_size: int
    per_rank_batch: int  # samples each rank loads per optimizer step
    microbatch: int  # samples per forward/backward on one device
    grad_accum: int  # microbatches per optimizer step on each rank


def derive_batching(global_batch: int, world_size: int, microbatch: int) -> Batching:
    """E.g. global 2048 on 256 GPUs with microbatch 4 -> 8 per rank, 2 accumulation steps."""
    if min(global_batch, world_size, microbatch) < 1:
        raise BatchingError(
            f"global_batch_size={global_batch}, world size={world_size} and "
            f"device_microbatch_size={microbatch} must all be >= 1"
        )
    if global_batch % world_size:
        raise BatchingError(
            f"global_batch_size={global_batch} is not divisible by the world size {world_size}; pick a "
            f"global batch that is a multiple of {world_size} or change the GPU count"
        )
    per_rank = global_batch // world_size
    if per_rank % microbatch:
        raise BatchingError(
            f"per-rank batch {per_rank} (global {global_batch} / {world_size} ranks) is not divisible by "
            f"device_microbatch_size={microbatch}; use a microbatch that divides {per_rank}"
        )
    return Batching(global_batch, world_size, per_rank, microbatch, per_rank // microbatch)
