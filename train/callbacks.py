"""Composer callbacks of this job: the run record kept in checkpoints, metrics JSONL, artifact mirroring."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from composer.core import Callback, Event, State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler

from shared import storage

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

    Everything logged during a batch (loss during it, throughput and LR at its end) is collected and written
    at that batch's end, keyed by the number of batches done. Composer runs logger destinations after the
    other callbacks of an event, so at BATCH_END this sees the speed/LR/ETA values, and the line is on disk
    before the CheckpointSaver (BATCH_CHECKPOINT) publishes that step: a kill between the two cannot lose
    it. After a resume, lines past the resumed step (written by the crashed run) are dropped so each step
    appears once.
    """

    def __init__(self, path: str):
        self.path = Path(path)
        self.pending: dict[str, Any] = {}

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for name, value in metrics.items():
            short = "lr" if name.startswith("lr-") and name.endswith("group0") else _METRIC_NAMES.get(name)
            if short is not None:
                self.pending[short] = float(value)

    def fit_start(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_lines_after(int(state.timestamp.batch))

    def batch_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        stamp = state.timestamp
        record = {
            "step": int(stamp.batch),
            "samples": int(stamp.sample),
            "epoch": int(stamp.epoch),
            "time": round(time.time(), 3),
            **self.pending,
        }
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        self.pending = {}

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


class RemoteCheckpointRetention(Callback):
    """Keeps the newest `keep` checkpoints in an s3:// save folder and deletes older ones.

    Composer's `save_num_checkpoints_to_keep` only prunes local copies. Runs on rank 0 at every checkpoint
    event and once more after the trainer closed. Composer uploads in the background, so during training the
    listing sees only finished uploads (a folder briefly holds keep + 1 checkpoints); after close every
    upload is done (its uploader joins them at fit end, after the non-logger callbacks of that event ran,
    hence `post_close` rather than `fit_end`). The checkpoint the `latest` pointer names is never deleted.
    """

    def __init__(self, save_folder: str, keep: int):
        self.save_folder = save_folder
        self.keep = keep
        self.closed = False

    def prune(self) -> list[str]:
        """Delete the old checkpoints; returns their URIs."""
        if dist.get_global_rank() != 0:
            return []
        from train.checkpoints import find_latest_checkpoint

        by_batch: dict[int, list[str]] = {}
        for info in storage.list_files(self.save_folder):
            match = _CHECKPOINT_NAME.match(storage.relpath(info.uri, self.save_folder))
            if match:
                by_batch.setdefault(int(match.group(1)), []).append(info.uri)
        latest = find_latest_checkpoint(self.save_folder)
        old = sorted(by_batch)[: -self.keep]
        doomed = [uri for batch in old for uri in by_batch[batch] if uri != latest]
        for uri in doomed:
            storage.delete(uri)
        if doomed:
            log.info("deleted %d old remote checkpoint file(s) from %s", len(doomed), self.save_folder)
        return doomed

    def prune_best_effort(self) -> None:
        # Old checkpoints are only clutter: an S3 hiccup while pruning must not stop a training run.
        try:
            self.prune()
        except storage.StorageError as err:
            log.warning(
                "could not prune old checkpoints in %s (will retry next checkpoint): %s",
                self.save_folder,
                err,
            )

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self.prune_best_effort()

    def post_close(self) -> None:
        # Composer may close an engine twice (explicitly, then at interpreter exit): prune once.
        if not self.closed:
            self.closed = True
            self.prune_best_effort()


def write_text_file(path: str, text: str) -> None:
    """Rank 0 writes a small file in the local run folder."""
    if dist.get_global_rank() != 0:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    storage.write_bytes(path, text.encode())
