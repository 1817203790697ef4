"""The host's work in whole Composer batches, counted as the bare step's is (train/bench/anatomy/profile.py):
top-level ATen ops (each a kernel launch on a GPU) and Python calls per batch, from one BEFORE_DATALOADER
to the one `batches` later. That is the data fetch, every event, clipping, the EMA, the callbacks and
Composer's own bookkeeping around the forward, backward and optimizer step: against the bare step's counts,
what the Composer loop adds on the host at the recipe's microbatch, where the host sets the pace (issue 30
item 5 at 8 images per GPU). On a GPU the backward's Python calls run on autograd's device thread and are
not counted, as in the bare step's count.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from train.bench.anatomy.profile import is_top_level_aten


@dataclass
class BatchCounts:
    """Counts the `batches` Composer batches after `start_after` completed ones."""

    start_after: int
    batches: int
    aten_ops: int = 0
    python_calls: int = 0
    done: bool = False
    _profiler: Any = None
    _previous: Any = None

    def at_batch_start(self, completed: int) -> None:
        """BEFORE_DATALOADER after `completed` batches (fired twice for the batch that ends an epoch)."""
        if self._profiler is None and not self.done and completed == self.start_after:
            self.start()
        elif self._profiler is not None and completed == self.start_after + self.batches:
            self.stop()

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU])
        self._profiler.start()
        self._previous = sys.getprofile()
        sys.setprofile(self._count_call)

    def _count_call(self, _frame: Any, event: str, _arg: Any) -> None:
        self.python_calls += event == "call"

    def stop(self) -> None:
        if self._profiler is None:
            return
        sys.setprofile(self._previous)
        self._profiler.stop()
        self.aten_ops = sum(1 for event in self._profiler.events() if is_top_level_aten(event))
        self._profiler, self.done = None, True

    def per_batch(self) -> dict[str, float]:
        if not self.done:
            ran = self.start_after + self.batches + 1
            raise RuntimeError(f"the trainer bench ran fewer than {ran} batches: no Composer batch counted")
        return {
            "batches": self.batches,
            "aten_ops_per_batch": self.aten_ops / self.batches,
            "python_calls_per_batch": self.python_calls / self.batches,
        }


def counting_callback(counts: BatchCounts) -> Any:
    from composer.core import Callback

    class BatchCountsCallback(Callback):
        """First in the callback list: the count starts before any other callback's handler runs."""

        def before_dataloader(self, state: Any, logger: Any) -> None:
            counts.at_batch_start(state.timestamp.batch.value)

        def fit_end(self, state: Any, logger: Any) -> None:
            counts.stop()

    return BatchCountsCallback()
