"""Count the torch.distributed collectives a block of code issues, and the bytes they move.

Per-step communication is invisible on one CPU and decisive on 256 GPUs (issue 11): tests and `make bench`
wrap a step, or a part of it, in `count_collectives()` and assert or report the totals. The count patches
the functions on the `torch.distributed` module, which is how FSDP, DDP's helpers and Composer call them
(`dist.all_gather_into_tensor(...)`), so a collective that bypasses that namespace is not seen: check a
count against a known positive (an FSDP all-gather) before trusting a zero.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

COUNTED = (
    "all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "all_reduce",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast",
    "broadcast_object_list", "all_to_all", "all_to_all_single", "scatter", "gather", "barrier",
)  # fmt: skip


@dataclass
class CollectiveCount:
    calls: dict[str, int] = field(default_factory=dict)
    bytes: int = 0  # bytes of the tensors passed in (outputs and inputs), a measure of volume per rank

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())


def tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def _counting(name: str, original: Callable[..., Any], count: CollectiveCount) -> Callable[..., Any]:
    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        count.calls[name] = count.calls.get(name, 0) + 1
        count.bytes += sum(tensor_bytes(a) for a in (*args, *kwargs.values()))
        return original(*args, **kwargs)

    return counted


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCount]:
    """Counts every collective issued through `torch.distributed` inside the block (this process only)."""
    count = CollectiveCount()
    originals = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}
    try:
        for name, original in originals.items():
            setattr(dist, name, _counting(name, original, count))
        yield count
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
