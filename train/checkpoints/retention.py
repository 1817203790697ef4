"""Checkpoint retention in s3:// save folders: keep the newest N, never the one `latest` names."""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Any

from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler

from shared import storage
from shared.runtime.background import CLOSE_WAIT_S, BackgroundJob
from train.checkpoints.files import UnsafeCheckpointError, find_latest_checkpoint

if TYPE_CHECKING:
    from train.config import TrainConfig

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------- retention
_CHECKPOINT_NAME = re.compile(r"^ep\d+-ba(\d+)-rank\d+\.pt$")
# A sharded checkpoint is a folder `ep{epoch}-ba{batch}/` (train/checkpoints/sharded.py): deleted whole.
_SHARDED_NAME = re.compile(r"^ep\d+-ba(\d+)$")


def checkpoints_to_delete(
    names_by_batch: dict[int, list[str]],
    latest_batch: int | None,
    keep: int,
    incomplete: frozenset[int] = frozenset(),
) -> list[str]:
    """Which checkpoints retention deletes: of those at or before the one `latest` names, all but the
    newest `keep` (latest always among them). Checkpoints after latest are never touched: in an s3://
    folder they are uploads Composer has not confirmed yet (it writes `latest` only after polling that the
    file exists, so deleting one stalls the job for up to an hour), or leftovers of a crashed attempt that
    the resumed run overwrites. No latest: nothing is confirmed, nothing is deleted.

    `incomplete`: batches of sharded folders without their `.metadata`. Below latest such a folder is what
    a crash left mid-save (saves go in batch order, so nothing is still writing it): it goes, and does
    not count as one of the `keep`, which would leave one good checkpoint fewer than asked for."""
    if latest_batch is None:
        return []
    broken = sorted(batch for batch in incomplete if batch < latest_batch and batch in names_by_batch)
    settled = sorted(batch for batch in names_by_batch if batch <= latest_batch and batch not in broken)
    old = sorted([*settled[: max(len(settled) - keep, 0)], *broken])
    return [name for batch in old for name in names_by_batch[batch]]


class CheckpointRetention(Callback):
    """Keeps the newest `keep` checkpoints in a save folder (local, shared filesystem or s3://).

    Composer prunes only the checkpoints the current process saved, and never remote ones, so after a
    cancel + resubmit a folder keeps every earlier job's checkpoints (~14 GB each for SD2-base). This lists
    the folder instead. It runs on rank 0, once per saved checkpoint (not per batch: Composer fires
    BATCH_CHECKPOINT after every batch), in a background thread so a slow listing never holds up a
    step (shared/runtime/background.py); a final pass runs after the trainer closed, when every upload and
    the final `latest` are written (Composer's uploader finishes at fit end, after the callbacks of that
    event, hence `post_close`), waited for at most `close_wait_s`. See checkpoints_to_delete for what may go.
    """

    def __init__(self, save_folder: str, keep: int, interval: Any, close_wait_s: float = CLOSE_WAIT_S):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.save_folder = save_folder
        self.keep = keep
        # The CheckpointSaver's own schedule (train/resilience/monitor.py: saves on a stop and on the clock
        # too), or an interval string.
        self.due = interval if callable(interval) else create_interval_scheduler(interval)
        self.saved_since_prune = False
        self.pruning = BackgroundJob("pruning old checkpoints")
        self.close_wait_s = close_wait_s  # for the last pass, after the trainer closed
        self.closed = False

    def prune(self) -> list[str]:
        """Delete the old checkpoints now; returns their URIs."""
        if dist.get_global_rank() != 0:
            return []
        by_batch: dict[int, list[str]] = {}
        sharded: set[int] = set()
        complete: set[int] = set()
        for info in storage.list_files(self.save_folder):
            name = storage.relpath(info.uri, self.save_folder)
            if match := _CHECKPOINT_NAME.match(name):
                by_batch.setdefault(int(match.group(1)), []).append(info.uri)
            elif "/" in name and (match := _SHARDED_NAME.match(name.split("/")[0])):
                batch = int(match.group(1))
                folder = storage.join(self.save_folder, match.group(0))
                sharded.add(batch)
                if name.split("/", 1)[1] == ".metadata":
                    complete.add(batch)
                if folder not in by_batch.setdefault(batch, []):
                    by_batch[batch].append(folder)
        incomplete = frozenset(sharded - complete)
        doomed = checkpoints_to_delete(by_batch, self._latest_batch(), self.keep, incomplete)
        for uri in doomed:
            if _CHECKPOINT_NAME.match(os.path.basename(uri)):
                storage.delete(uri)
            else:  # s3: delete_tree goes in key order, `.metadata` (marks the folder complete) first
                storage.delete_tree(uri)
        if doomed:
            log.info("deleted %d old checkpoint file(s) from %s", len(doomed), self.save_folder)
        return doomed

    def _latest_batch(self) -> int | None:
        latest = find_latest_checkpoint(self.save_folder)
        name = os.path.basename(latest.rstrip("/")) if latest else ""
        match = _CHECKPOINT_NAME.match(name) or _SHARDED_NAME.match(name)
        return int(match.group(1)) if match else None

    def prune_best_effort(self) -> None:
        # Old checkpoints are only clutter: an S3 hiccup or a damaged `latest` must not stop training here
        # (a damaged latest stops the next resume, loudly).
        try:
            self.prune()
        except (OSError, UnsafeCheckpointError) as err:
            log.warning(
                "could not prune old checkpoints in %s (will retry next checkpoint): %s",
                self.save_folder,
                err,
            )

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        # This runs before Composer's CheckpointSaver within the event: remember, prune after it saved.
        if dist.get_global_rank() == 0 and self.due(state, Event.BATCH_CHECKPOINT):
            self.saved_since_prune = True

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() == 0 and self.due(state, Event.EPOCH_CHECKPOINT):
            self.saved_since_prune = True

    def batch_start(self, state: State, logger: Logger) -> None:
        if self.saved_since_prune and self.pruning.start(self.prune_best_effort):
            self.saved_since_prune = False  # else the last prune still runs: try at the next batch

    def post_close(self) -> None:
        # Composer may close an engine twice (explicitly, then at interpreter exit): prune once.
        if self.closed:
            return
        self.closed = True
        if not self.pruning.last(self.prune_best_effort, timeout_s=self.close_wait_s):
            log.warning(
                "gave up pruning %s at close (S3 is not answering); the next run prunes", self.save_folder
            )


def save_folder_keep(cfg: TrainConfig) -> int:
    """How many checkpoints CheckpointRetention keeps in save_folder (<= 0: it does not run)."""
    if cfg.save_is_remote():
        return cfg.save_num_remote_checkpoints_to_keep
    return cfg.save_num_checkpoints_to_keep


def composer_keep(cfg: TrainConfig) -> int:
    """Composer's own pruning: of its local copies of an s3:// run; off (-1) for a local save folder, where
    CheckpointRetention prunes by listing (Composer's pruning forgets earlier jobs, and its os.remove
    would fail on a file retention already deleted)."""
    if cfg.save_is_remote() or cfg.save_num_checkpoints_to_keep <= 0:
        return cfg.save_num_checkpoints_to_keep
    return -1
