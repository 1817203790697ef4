"""The GPU run's memory monitor reports at the console interval, not every batch (issue 30 (5))."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from composer.callbacks import MemoryMonitor

from train.loop.memory import IntervalMemoryMonitor


def test_reports_after_every_nth_batch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    reported: list[int] = []
    monkeypatch.setattr(
        MemoryMonitor, "after_train_batch", lambda self, state, logger: reported.append(state.n)
    )
    monitor = IntervalMemoryMonitor(every=5)
    for done in range(12):  # Composer's batch count at AFTER_TRAIN_BATCH: batches finished before this one
        monitor.after_train_batch(SimpleNamespace(timestamp=SimpleNamespace(batch=done), n=done + 1), None)
    assert reported == [5, 10]  # the 5th and 10th batch, as the loss lines
    assert IntervalMemoryMonitor(every=0).every == 1
