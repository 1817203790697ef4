"""Samples seen per stream of the run's data, cumulative over resumes: `data/samples/<name>` in
metrics.jsonl, a console line and the end-of-run summary.

Each rank's loader counts the samples it hands to the trainer from a host-side column (`stream_index`,
train/data/loader.py), so counting costs no device work. The ranks' counts are summed with one small
object all-gather, only when a console line or a checkpoint is due (never every step), and the sum is what
the checkpoint keeps: a resume on any number of ranks adds its own counts to it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler

log = logging.getLogger(__name__)

METRIC_PREFIX = "data/samples/"


class StreamSampleCounts(Callback):
    """Cumulative samples per stream; `totals()` is the sum over ranks and earlier attempts."""

    def __init__(self, names: list[str], loader: Any, console_interval: str, save_interval: str):
        self.names = list(names)
        self.loader = loader
        # At BATCH_END / EPOCH_END (and the last batch), before the checkpoint events that save the counts.
        ends = {Event.BATCH_END}
        self.console_due = create_interval_scheduler(
            console_interval, checkpoint_events=False, final_events=ends
        )
        self.save_due = create_interval_scheduler(save_interval, checkpoint_events=False, final_events=ends)
        self.base = np.zeros(len(names), np.int64)  # counted by earlier attempts (from the checkpoint)
        self.synced = self.base.copy()  # the last all-ranks total

    def totals(self) -> dict[str, int]:
        return dict(zip(self.names, (int(v) for v in self.synced), strict=True))

    def _sync(self) -> None:
        gathered = dist.all_gather_object(self.loader.stream_taken.tolist())
        self.synced = self.base + np.sum(np.asarray(gathered, np.int64), axis=0)

    def batch_end(self, state: State, logger: Logger) -> None:
        console, save = self.console_due(state, Event.BATCH_END), self.save_due(state, Event.BATCH_END)
        if not (console or save):
            return
        self._sync()
        totals = self.totals()
        logger.log_metrics({METRIC_PREFIX + n: v for n, v in totals.items()}, step=int(state.timestamp.batch))
        if console and dist.get_global_rank() == 0:
            log.info("samples per stream at step %d: %s", int(state.timestamp.batch), describe(totals))

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.save_due(state, Event.EPOCH_END):  # save_interval in epochs: sync before EPOCH_CHECKPOINT
            self._sync()

    def fit_end(self, state: State, logger: Logger) -> None:
        # The last batch already logged its counts (both interval schedulers fire at the end of training).
        self._sync()
        totals = self.totals()
        if dist.get_global_rank() == 0:
            log.info("run summary, samples per stream: %s", describe(totals))
            print(f"samples per stream: {describe(totals)}", flush=True)

    def state_dict(self) -> dict[str, Any]:
        return {"names": self.names, "totals": [int(v) for v in self.synced]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the counts of the streams this run still reads (a changed mix starts new names at 0)."""
        saved = dict(zip(state.get("names", []), state.get("totals", []), strict=False))
        self.base = np.array([int(saved.get(n, 0)) for n in self.names], np.int64)
        self.synced = self.base.copy()


def describe(totals: dict[str, int]) -> str:
    whole = sum(totals.values()) or 1
    return ", ".join(f"{n} {v} ({100 * v / whole:.1f}%)" for n, v in totals.items())
