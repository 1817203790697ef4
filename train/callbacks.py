"""Composer callbacks of this job: the run record kept in checkpoints, metrics JSONL, artifact mirroring."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from composer.core import Callback, Event, State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler

from shared import storage
from train.checkpoints import UnsafeCheckpointError, find_latest_checkpoint

log = logging.getLogger(__name__)


class DatasetChangedError(RuntimeError):
    """A resume would continue on other data than the checkpoint was trained on."""


# ------------------------------------------------------------------------------------------ run record
def check_dataset_unchanged(saved: dict[str, Any], current: dict[str, Any], allow: bool) -> None:
    """Refuse to resume on other data than the checkpoint's, unless `allow` (data.allow_dataset_change)."""
    before, now = saved.get("dataset", {}), current.get("dataset", {})
    changed = [k for k in ("fingerprint", "resolution") if before.get(k) != now.get(k)]
    if not changed:
        return
    what = (
        f"the checkpoint was trained on {before.get('uri')} version {before.get('version')} at "
        f"{before.get('resolution')} px (fingerprint {before.get('fingerprint')}) but this run reads "
        f"{now.get('uri')} version {now.get('version')} at {now.get('resolution')} px (fingerprint "
        f"{now.get('fingerprint')})"
    )
    if allow:
        log.warning("data.allow_dataset_change=true: resuming although %s", what)
        return
    raise DatasetChangedError(
        f"refusing to resume: {what}. Pass data.version={before.get('version')} (and the original data.uri / "
        "data.resolution) to continue on the same data, or data.allow_dataset_change=true to switch datasets."
    )


class RunRecord(Callback):
    """What the run trained on and with, saved in every checkpoint (`state["callbacks"]["RunRecord"]`).

    Holds the dataset identity (uri, version, resolution, fingerprint), the model recipe (preset, U-Net
    config, prediction type, noise schedule) and the encoders the latents were made with (the manifest's
    `config.encoder` and `fingerprints.encoders`), so export rebuilds the same VAE and text encoder.
    Loading a checkpoint (autoresume / load_path without weights-only) checks the dataset is unchanged.
    """

    def __init__(self, record: dict[str, Any], allow_dataset_change: bool = False):
        self.record = record
        self.allow_dataset_change = allow_dataset_change

    def state_dict(self) -> dict[str, Any]:
        return dict(self.record)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_dataset_unchanged(state, self.record, self.allow_dataset_change)


# ----------------------------------------------------------------------------------------- metrics
_LOSS_METRIC = "loss/train/total"  # logged per step by train/step_loop.py's StepLossLog, with its step
# Composer metric name -> short name in metrics.jsonl
_METRIC_NAMES = {
    "loss/train/total": "loss",
    "throughput/samples_per_sec": "images_per_s",
    "throughput/device/samples_per_sec": "images_per_s_per_device",
    "time/remaining_estimate": "eta_hours",
    "memory/peak_allocated_mem": "peak_mem_gb",
}


class MetricsJSONL(LoggerDestination):
    """One JSON line per optimizer step: step, loss, lr, images/s (overall and per device), ETA, memory.

    Everything logged during a batch (throughput and LR at its end) is collected at that batch's end, keyed
    by the number of batches done. The loss comes later and for several steps at once: it stays on the
    device during training (train/step_loop.py) and is logged with its step number every
    `log.console_interval` batches and before every checkpoint. A step's line is written as soon as both
    halves are in, in step order. StepLossLog runs before the CheckpointSaver in the BATCH_CHECKPOINT event
    (Composer appends the saver after the job's callbacks), so every step a checkpoint covers is on disk
    before the checkpoint is published: a kill between the two cannot lose a line. After a resume, lines
    past the resumed step (written by the crashed run) are dropped so each step appears once.
    """

    def __init__(self, path: str):
        self.path = Path(path)
        self.pending: dict[str, Any] = {}
        self.records: dict[int, dict[str, Any]] = {}  # finished steps waiting for their loss
        self.losses: dict[int, float] = {}  # losses waiting for their step's end

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for name, value in metrics.items():
            if name == _LOSS_METRIC and step is not None:
                self.losses[int(step)] = float(value)
                continue
            short = "lr" if name.startswith("lr-") and name.endswith("group0") else _METRIC_NAMES.get(name)
            if short is not None:
                self.pending[short] = float(value)
        if _LOSS_METRIC in metrics:
            self._write_complete()

    def fit_start(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_lines_after(int(state.timestamp.batch))

    def batch_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        stamp = state.timestamp
        self.records[int(stamp.batch)] = {
            "step": int(stamp.batch),
            "samples": int(stamp.sample),
            "epoch": int(stamp.epoch),
            "time": round(time.time(), 3),
            **self.pending,
        }
        self.pending = {}
        self._write_complete()

    def fit_end(self, state: State, logger: Logger) -> None:
        # Steps whose loss never came (a run without StepLossLog) are still written, without it.
        self._write_complete(force=True)

    def _write_complete(self, force: bool = False) -> None:
        """Append the lines of the oldest steps that have both their end-of-step values and their loss."""
        if dist.get_global_rank() != 0:
            return
        lines = []
        for step in sorted(self.records):
            if step not in self.losses and not force:
                break
            record = self.records.pop(step)
            if step in self.losses:
                record["loss"] = self.losses.pop(step)
            lines.append(json.dumps(record) + "\n")
        if lines:
            with self.path.open("a") as handle:
                handle.write("".join(lines))

    def _drop_lines_after(self, step: int) -> None:
        if not self.path.exists():
            return
        keep = [
            line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in keep))


# ----------------------------------------------------------------------------------------- mirroring
class ArtifactMirror(Callback):
    """Copies the local run folder (log, metrics, samples, config) to an s3:// save folder.

    Composer uploads checkpoints itself; this keeps the small human-facing files next to them. Runs on
    rank 0 at each checkpoint interval and at the end of training; only changed files are uploaded. Files
    that runs append to (`restore`) are fetched back first when this machine has no local copy (a resume
    elsewhere), so the remote copy is extended rather than overwritten.
    """

    def __init__(self, local_dir: str, remote_dir: str, interval: str, restore: tuple[str, ...] = ()):
        self.local_dir = Path(local_dir)
        self.remote_dir = remote_dir
        self.due = create_interval_scheduler(interval)
        self.restore = restore
        self.sent: dict[str, tuple[int, int]] = {}

    def init(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        for name in self.restore:
            local, remote = self.local_dir / name, storage.join(self.remote_dir, name)
            if not local.exists() and storage.exists(remote):
                storage.write_bytes(str(local), storage.read_bytes(remote))

    def sync(self) -> None:
        if dist.get_global_rank() != 0 or not self.local_dir.exists():
            return
        for path in sorted(p for p in self.local_dir.rglob("*") if p.is_file()):
            stat = path.stat()
            key = str(path.relative_to(self.local_dir))
            if self.sent.get(key) == (stat.st_size, stat.st_mtime_ns):
                continue
            storage.write_bytes(storage.join(self.remote_dir, key), path.read_bytes())
            self.sent[key] = (stat.st_size, stat.st_mtime_ns)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        if self.due(state, Event.BATCH_CHECKPOINT):
            self.sync()

    def fit_end(self, state: State, logger: Logger) -> None:
        self.sync()


# ----------------------------------------------------------------------------------------- retention
_CHECKPOINT_NAME = re.compile(r"^ep\d+-ba(\d+)-rank\d+\.pt$")
# A sharded checkpoint is a folder `ep{epoch}-ba{batch}/` (train/checkpoints_sharded.py): deleted whole.
_SHARDED_NAME = re.compile(r"^ep\d+-ba(\d+)$")


def checkpoints_to_delete(
    names_by_batch: dict[int, list[str]], latest_batch: int | None, keep: int
) -> list[str]:
    """Which checkpoints retention deletes: of those at or before the one `latest` names, all but the
    newest `keep` (latest always among them). Checkpoints after latest are never touched: in an s3://
    folder they are uploads Composer has not confirmed yet (it writes `latest` only after polling that the
    file exists, so deleting one stalls the job for up to an hour), or leftovers of a crashed attempt that
    the resumed run overwrites. No latest: nothing is confirmed, nothing is deleted."""
    if latest_batch is None:
        return []
    settled = sorted(batch for batch in names_by_batch if batch <= latest_batch)
    old = settled[: max(len(settled) - keep, 0)]
    return [name for batch in old for name in names_by_batch[batch]]


class CheckpointRetention(Callback):
    """Keeps the newest `keep` checkpoints in a save folder (local, shared filesystem or s3://).

    Composer prunes only the checkpoints the current process saved, and never remote ones, so after a
    cancel + resubmit a folder keeps every earlier job's checkpoints (~14 GB each for SD2-base). This lists
    the folder instead. It runs on rank 0, once per saved checkpoint (not per batch: Composer fires
    BATCH_CHECKPOINT after every batch), in one background worker so a slow listing never holds up a
    step; the worker is joined and a final pass runs after the trainer closed, when every upload and the
    final `latest` are written (Composer's uploader finishes at fit end, after the callbacks of that event,
    hence `post_close`). See checkpoints_to_delete for what may go.
    """

    def __init__(self, save_folder: str, keep: int, interval: str):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.save_folder = save_folder
        self.keep = keep
        self.due = create_interval_scheduler(interval)
        self.saved_since_prune = False
        self.worker: ThreadPoolExecutor | None = None
        self.closed = False

    def prune(self) -> list[str]:
        """Delete the old checkpoints now; returns their URIs."""
        if dist.get_global_rank() != 0:
            return []
        by_batch: dict[int, list[str]] = {}
        for info in storage.list_files(self.save_folder):
            name = storage.relpath(info.uri, self.save_folder)
            if match := _CHECKPOINT_NAME.match(name):
                by_batch.setdefault(int(match.group(1)), []).append(info.uri)
            elif "/" in name and (match := _SHARDED_NAME.match(name.split("/")[0])):
                folder = storage.join(self.save_folder, match.group(0))
                if folder not in by_batch.setdefault(int(match.group(1)), []):
                    by_batch[int(match.group(1))].append(folder)
        doomed = checkpoints_to_delete(by_batch, self._latest_batch(), self.keep)
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
        if self.saved_since_prune:
            self.saved_since_prune = False
            if self.worker is None:
                self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-retention")
            self.worker.submit(self.prune_best_effort)

    def post_close(self) -> None:
        # Composer may close an engine twice (explicitly, then at interpreter exit): prune once.
        if self.closed:
            return
        self.closed = True
        if self.worker is not None:
            self.worker.shutdown(wait=True)
        self.prune_best_effort()


def write_text_file(path: str, text: str) -> None:
    """Rank 0 writes a small file in the local run folder."""
    if dist.get_global_rank() != 0:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    storage.write_bytes(path, text.encode())
