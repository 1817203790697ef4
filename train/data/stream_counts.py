"""Samples seen per stream of the run's data, cumulative over resumes: `data/samples/<name>` per dataset of
a data.streams mix and `data/buckets/<HxW>` per bucket of bucketed data (pixel shape) in metrics.jsonl, a
console line and the end-of-run summary. Written at the run's last step too (`is_last_batch`: Composer's
own end-of-training check cannot see it at BATCH_END of an epoch-long run).

Each rank's loader counts the samples it hands to the trainer from a host-side column (`stream_index`,
train/data/packing.py), so counting costs no device work. The ranks' counts are summed with one small
object all-gather, only when a console line or a checkpoint is due (never every step), and the sum is what
the checkpoint keeps: a resume on any number of ranks adds its own counts to it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from composer.core import Callback, Event, State, TimeUnit
from composer.loggers import Logger
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler

log = logging.getLogger(__name__)

METRIC_PREFIX = "data/samples/"
BUCKET_PREFIX = "data/buckets/"


def is_last_batch(state: State) -> bool:
    """Whether the batch that just ended is the run's last. Composer's interval schedulers fire their final
    events only once elapsed duration reaches 1, which a max_duration in epochs does at EPOCH_END, after
    the last BATCH_END: counts logged only then miss the last step's metrics line."""
    elapsed = state.get_elapsed_duration()
    if elapsed is not None and elapsed >= 1.0:
        return True
    limit, length = state.max_duration, state.dataloader_len
    if limit is None or limit.unit != TimeUnit.EPOCH or length is None:
        return False
    stamp = state.timestamp
    return int(stamp.epoch) + 1 >= int(limit.value) and int(stamp.batch_in_epoch) >= int(length)


class StreamSampleCounts(Callback):
    """Cumulative samples per Streaming stream; `totals()` sums them by dataset and by bucket, over ranks
    and earlier attempts."""

    def __init__(
        self, labels: list[Any], loader: Any, console_interval: str, save_interval: str, saves: Any = None
    ):
        self.labels = list(labels)  # train/data/buckets.py StreamLabel, one per Streaming stream
        self.names = [label.key for label in self.labels]
        self.loader = loader
        # At BATCH_END / EPOCH_END (and the last batch), before the checkpoint events that save the counts.
        ends = {Event.BATCH_END}
        self.console_due = create_interval_scheduler(
            console_interval, checkpoint_events=False, final_events=ends
        )
        self.save_due = create_interval_scheduler(save_interval, checkpoint_events=False, final_events=ends)
        self.saves = saves  # the CheckpointSaver's schedule: it also saves on a stop, a deadline, the clock
        self.base = np.zeros(len(self.names), np.int64)  # counted by earlier attempts (from the checkpoint)
        self.synced = self.base.copy()  # the last all-ranks total
        self.logged_step = -1  # the step whose counts were logged last

    def totals(self) -> dict[str, int]:
        """metric name -> cumulative samples: per dataset of a mix, per bucket of bucketed data."""
        out: dict[str, int] = {}
        for label, value in zip(self.labels, self.synced, strict=True):
            for prefix, part in ((METRIC_PREFIX, label.dataset), (BUCKET_PREFIX, label.bucket)):
                if part:
                    out[prefix + part] = out.get(prefix + part, 0) + int(value)
        return out

    def _sync(self) -> None:
        gathered = dist.all_gather_object(self.loader.stream_taken.tolist())
        self.synced = self.base + np.sum(np.asarray(gathered, np.int64), axis=0)

    def batch_end(self, state: State, logger: Logger) -> None:
        console, save = self.console_due(state, Event.BATCH_END), self.save_due(state, Event.BATCH_END)
        last = is_last_batch(state)
        if not (console or save or last):
            return
        self._log(state, logger, console or last)

    def _log(self, state: State, logger: Logger, console: bool) -> None:
        self._sync()
        totals = self.totals()
        self.logged_step = int(state.timestamp.batch)
        logger.log_metrics(totals, step=self.logged_step)
        if console and dist.get_global_rank() == 0:
            log.info("samples per stream at step %d: %s", self.logged_step, describe(totals))

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        # Before the CheckpointSaver (appended after the job's callbacks): a save the monitor decided at this
        # step boundary (every rank alike) holds this step's counts, not the last interval's.
        step = int(state.timestamp.batch)
        if self.saves is not None and self.logged_step != step and self.saves(state, Event.BATCH_CHECKPOINT):
            self._sync()

    def epoch_end(self, state: State, logger: Logger) -> None:
        elapsed = state.get_elapsed_duration()
        if elapsed is not None and elapsed >= 1.0 and self.logged_step != int(state.timestamp.batch):
            # The run's last epoch ended before `dataloader_len` batches (per_stream batching drops each
            # bucket's partial batch): its last step's line is written at EPOCH_CHECKPOINT, after this.
            self._log(state, logger, True)
        elif self.save_due(state, Event.EPOCH_END):  # save_interval in epochs: sync before EPOCH_CHECKPOINT
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
    """`name count (share%)` per dataset, then per bucket (each group's shares add up to 100%)."""
    parts = []
    for prefix in (METRIC_PREFIX, BUCKET_PREFIX):
        group = {n.removeprefix(prefix): v for n, v in totals.items() if n.startswith(prefix)}
        whole = sum(group.values()) or 1
        parts += [f"{n} {v} ({100 * v / whole:.1f}%)" for n, v in group.items()]
    return ", ".join(parts)
