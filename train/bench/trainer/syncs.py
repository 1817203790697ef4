"""Count the places a training run reads tensors back to the host (`.item()`, `.tolist()`, `.cpu()`, ...).

On a GPU each such read of a device tensor is a host-device sync: the host waits until the device has
finished everything queued before it, so it cannot queue the next step's work meanwhile. On CPU nothing
syncs, but the same calls show where a GPU run would: `count_readbacks` patches the read-back methods of
`torch.Tensor` and records, per training step, each call made directly from the train job's code, Composer
or diffusers. Calls from inside torch itself are left out: those are its host-side bookkeeping (e.g.
AdamW's step counter, which lives on the host), not reads of device results. On a GPU,
`torch.cuda.set_sync_debug_mode` sees every sync (tests/train/test_gpu.py).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import train

READBACK_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
REPO_TRAIN = Path(train.__file__).resolve().parent  # the train package
# Origins counted: the train job (its bench excluded), and the libraries that run its step.
LIBRARIES = ("composer", "diffusers")


@functools.cache  # called on every read-back, torch's own too (unfused AdamW reads its step per tensor)
def origin_of(filename: str) -> str | None:
    """`train/loop/guards.py`, `composer/trainer/trainer.py`, ... for counted code; None for anything else."""
    path = Path(filename)
    if path.is_relative_to(REPO_TRAIN):
        rel = path.relative_to(REPO_TRAIN)
        return None if rel.parts[0] == "bench" else f"train/{rel.as_posix()}"
    parts = path.parts
    for library in LIBRARIES:
        if library in parts and "site-packages" in parts:
            return "/".join(parts[parts.index(library) :])
    return None


@dataclass
class Readbacks:
    """Read-backs by training step (the step number as metrics.jsonl names it; 0: before the first)."""

    step: int = 0
    by_step: dict[int, Counter[str]] = field(default_factory=dict)

    def record(self, where: str) -> None:
        self.by_step.setdefault(self.step, Counter())[where] += 1

    def at(self, step: int) -> Counter[str]:
        return self.by_step.get(step, Counter())

    def steps_with(self, prefix: str) -> list[int]:
        """The steps with a read-back from code whose origin starts with `prefix` (e.g. "train/")."""
        return sorted(s for s, c in self.by_step.items() if any(w.startswith(prefix) for w in c))


def _counting(method: Callable[..., Any], counts: Readbacks) -> Callable[..., Any]:
    @functools.wraps(method)
    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        where = origin_of(caller.f_code.co_filename)
        if where is not None:
            counts.record(f"{where}:{caller.f_code.co_name}")
        return method(self, *args, **kwargs)

    return counted


@contextlib.contextmanager
def count_readbacks() -> Iterator[Readbacks]:
    """Patch torch.Tensor's read-back methods for the block (this process, every thread)."""
    counts = Readbacks()
    originals = {name: getattr(torch.Tensor, name) for name in READBACK_METHODS}
    try:
        for name, method in originals.items():
            setattr(torch.Tensor, name, _counting(method, counts))
        yield counts
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def step_tracker(counts: Readbacks) -> Any:
    """A Composer callback that tells `counts` which step is running (put it first in the list)."""
    from composer.core import Callback

    class ReadbackStep(Callback):
        def batch_start(self, state: Any, logger: Any) -> None:
            counts.step = int(state.timestamp.batch) + 1

    return ReadbackStep()
