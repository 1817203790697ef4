"""What the run writes beside its checkpoints: metrics.jsonl, the small files mirrored to an s3:// save
folder."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from composer.core import Callback, Event, State
from composer.loggers import FileLogger, Logger, LoggerDestination
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler

from shared import storage
from shared.runtime.background import CLOSE_WAIT_S, BackgroundJob
from shared.storage import StorageError

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------- metrics
_LOSS_METRIC = "loss/train/total"  # logged per step by train/loop/step.py's StepLossLog, with its step
_EVAL_PREFIX = "eval/"  # held-out loss metrics (train/eval/callback.py), written under their own names
_TAIL_BYTES = 1 << 16  # a metrics line is ~300 bytes (with an eval at 20 timesteps ~1.5 KB)
# Composer metric name -> short name in metrics.jsonl
_METRIC_NAMES = {
    "loss/train/total": "loss",
    "throughput/samples_per_sec": "images_per_s",
    "throughput/device/samples_per_sec": "images_per_s_per_device",
    "time/remaining_estimate": "eta_hours",
    "memory/peak_allocated_mem": "peak_mem_gb",
}
# Metrics kept under their own name in the line of the step they are logged with (train/data/stream_counts.py)
_STEP_METRIC_PREFIXES = ("data/samples/", "data/buckets/")


class MetricsJSONL(LoggerDestination):
    """One JSON line per optimizer step: step, loss, lr, images/s (overall and per device), ETA, memory.

    Everything logged during a batch (throughput and LR at its end) is collected at that batch's end, keyed
    by the number of batches done. The loss comes later and for several steps at once: it stays on the
    device during training (train/loop/step.py) and is logged with its step number every
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
        self.step_values: dict[int, dict[str, Any]] = {}  # per-step metrics logged with their step

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if dist.get_global_rank() != 0:  # only rank 0 writes: elsewhere every step's loss piled up here
            return  # (108 B a step: 108 MB a rank over 1M steps)
        evals = {name: float(value) for name, value in metrics.items() if name.startswith(_EVAL_PREFIX)}
        if evals and step is not None:
            self._add_eval(int(step), evals)
        for name, value in metrics.items():
            if name == _LOSS_METRIC and step is not None:
                self.losses[int(step)] = float(value)
                continue
            if step is not None and name.startswith(_STEP_METRIC_PREFIXES):
                self.step_values.setdefault(int(step), {})[name] = value
                continue
            short = "lr" if name.startswith("lr-") and name.endswith("group0") else _METRIC_NAMES.get(name)
            if short is not None:
                self.pending[short] = float(value)
        if _LOSS_METRIC in metrics:
            self._write_complete()

    def _add_eval(self, step: int, evals: dict[str, float]) -> None:
        """The held-out loss (train/eval/) joins its step's line: the pending record, or the last line of the
        file when the step's loss was flushed at BATCH_END (one line per step either way)."""
        if dist.get_global_rank() != 0:
            return
        if step in self.records:
            self.records[step].update(evals)
            return
        with self.path.open("a+b") as handle:
            handle.seek(0, os.SEEK_END)
            end = handle.tell()
            start = max(0, end - _TAIL_BYTES)
            handle.seek(start)
            tail = handle.read()
            cut = tail.rfind(b"\n", 0, len(tail) - 1) + 1  # where the last line starts
            last = json.loads(tail[cut:]) if tail[cut:].strip() and (cut or not start) else {}
            if last.get("step") == step:  # the step's line is written: add the eval to it, in place
                handle.truncate(start + cut)
                evals = {**last, **evals}
            else:
                evals = {"step": step, **evals}
            handle.write((json.dumps(evals) + "\n").encode())

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
            record.update(self.step_values.pop(step, {}))
            lines.append(json.dumps(record) + "\n")
        if lines:
            with self.path.open("a") as handle:
                handle.write("".join(lines))

    def _drop_lines_after(self, step: int) -> None:
        """Cut the file after its last line of a step <= `step`, reading back from its end only as far as
        that line (lines are in step order; a damaged one, from a kill mid-write, goes too): every start read
        and rewrote the whole file (1M steps: 222 MB, 3.8 s and 745 MB of memory at each restart), and a
        kill during the rewrite lost the history."""
        if not self.path.exists():
            return
        with self.path.open("r+b") as handle:
            end = pos = handle.seek(0, os.SEEK_END)
            data = b""
            while True:
                start = max(0, pos - _TAIL_BYTES)
                handle.seek(start)
                data = handle.read(pos - start) + data
                pos = start
                lines = data.split(b"\n")
                head = lines.pop(0) if start else b""  # maybe part of a line: read on with the next block
                kept = _end_of_last_line_at_or_before(lines, start + len(head) + 1 if start else 0, step)
                if kept is not None or not start:
                    handle.truncate(min(end, kept or 0))
                    return
                data = head


def _end_of_last_line_at_or_before(lines: list[bytes], offset: int, step: int) -> int | None:
    """Where the file ends once the last of `lines` (consecutive, the first at `offset`) of a step <= `step`
    is kept, its newline included; None when none of them is."""
    kept = None
    for line in lines:
        try:
            if line.strip() and int(json.loads(line)["step"]) <= step:
                kept = offset + len(line) + 1
        except (ValueError, KeyError, TypeError):
            pass
        offset += len(line) + 1
    return kept


class IntervalFileLogger(FileLogger):
    """Composer's FileLogger (each rank's text log), with metrics every `every` steps and no algorithm
    traces: it wrote 16 metric lines and 3 trace lines a step on every rank, ~950 bytes a step (0.93 GB a
    rank over 1M steps, all re-uploaded to an s3:// save folder at every checkpoint); metrics.jsonl has
    every step's values."""

    def __init__(self, filename: str, every: int):
        before = [(stream, _own_write(stream)) for stream in (sys.stdout, sys.stderr)]
        super().__init__(filename=filename, overwrite=True, log_traces=False)
        self.every = max(1, every)
        self._interceptions = [(stream, was, _own_write(stream)) for stream, was in before]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if step is None or step % self.every == 0:
            super().log_metrics(metrics, step)

    def close(self, state: State, logger: Logger) -> None:
        super().close(state, logger)
        self.stop_intercepting()

    def stop_intercepting(self) -> None:
        """Take Composer's writers off sys.stdout / sys.stderr. FileLogger wraps their `write` in every
        instance and never unwraps: each trainer a process built added one more wrapper to every print,
        which kept that trainer's logger alive, and through the callbacks its whole State. A stream that
        someone wrapped again after us keeps its chain (only our writer goes quiet, as Composer's does)."""
        for stream, was, ours in self._interceptions:
            if ours is None or _own_write(stream) is not ours:
                continue
            if was is None:
                del stream.write
            else:
                stream.write = was
        self._interceptions = []


def _own_write(stream: Any) -> Any:
    """The `write` set on the stream object itself (a wrapper), None when it is the class's method."""
    return getattr(stream, "__dict__", {}).get("write")


# ----------------------------------------------------------------------------------------- mirroring
class ArtifactMirror(Callback):
    """Copies the local run folder (log, metrics, samples, config) to an s3:// save folder.

    Composer uploads checkpoints itself; this keeps the small human-facing files next to them. Runs on
    rank 0 at each checkpoint interval and once more after the trainer closed (Composer's log file is
    complete then: a copy at FIT_END lacked the run's last lines); only changed files are uploaded. The
    interval copies run in a background thread on bytes read at the checkpoint: during an S3 outage one
    file's write takes the client's retries (~30 s seen, minutes at worst), for each file, and the step
    of rank 0 waited that long at each checkpoint while every other rank waited in a collective (which
    times out at resilience.collective_timeout_s). Files that runs append to (`restore`) are fetched back
    first when this machine has no local copy (a resume elsewhere), so the remote copy is extended rather
    than overwritten.
    """

    def __init__(
        self,
        local_dir: str,
        remote_dir: str,
        interval: Any,
        restore: tuple[str, ...] = (),
        close_wait_s: float = CLOSE_WAIT_S,
    ):
        self.local_dir = Path(local_dir)
        self.close_wait_s = close_wait_s  # for the last copy, after the trainer closed
        self.remote_dir = remote_dir
        # The CheckpointSaver's schedule (a stop saves, then raises before FIT_END).
        self.due = interval if callable(interval) else create_interval_scheduler(interval)
        self.restore = restore
        self.sent: dict[str, tuple[int, int]] = {}
        self.copying = BackgroundJob("copying the run folder to S3")
        self.started = False  # a run that never reached FIT_START (refused at its start) copies nothing
        self.closed = False

    def init(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        for name in self.restore:
            local, remote = self.local_dir / name, storage.join(self.remote_dir, name)
            if not local.exists() and storage.exists(remote):
                storage.write_bytes(str(local), storage.read_bytes(remote))

    def fit_start(self, state: State, logger: Logger) -> None:
        self.started = True

    def sync(self) -> None:
        """Copy what changed, now. Best effort: a copy that fails (an S3 outage) is retried at the next sync,
        and never stops the run (it stopped an unattended one for good: a failed copy of the log was a fatal
        error)."""
        if dist.get_global_rank() == 0:
            self.send(self.changed_files())

    def changed_files(self) -> list[tuple[str, bytes, tuple[int, int]]]:
        """(name, bytes, (size, mtime)) of every file not copied as it is now; read in the caller's thread,
        so a line appended meanwhile is in this copy or the next, never half in one."""
        if not self.local_dir.exists():
            return []
        changed = []
        for path in sorted(p for p in self.local_dir.rglob("*") if p.is_file()):
            stat = path.stat()
            key = str(path.relative_to(self.local_dir))
            if self.sent.get(key) != (stat.st_size, stat.st_mtime_ns):
                changed.append((key, path.read_bytes(), (stat.st_size, stat.st_mtime_ns)))
        return changed

    def send(self, files: list[tuple[str, bytes, tuple[int, int]]]) -> None:
        failed: list[str] = []
        error: StorageError | None = None
        for key, data, stamp in files:
            if error is not None and error.transient:  # S3 is down: the rest waits for the next sync
                failed.append(key)
                continue
            try:
                storage.write_bytes(storage.join(self.remote_dir, key), data)
            except StorageError as err:
                failed.append(key)
                error = err
                continue
            self.sent[key] = stamp
        if failed:
            log.warning(
                "could not copy %d file(s) (%s) to %s; they stay in %s and are copied at the next "
                "checkpoint: %s",
                len(failed), ", ".join(failed[:3]) + (", ..." if len(failed) > 3 else ""),
                self.remote_dir, self.local_dir, error,
            )  # fmt: skip

    def sync_in_background(self) -> None:
        """Start a copy of what changed; skipped while the last one still runs (the next one catches up)."""
        if dist.get_global_rank() == 0 and not self.copying.busy():
            self.copying.start(self.send, self.changed_files())

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        if self.due(state, Event.BATCH_CHECKPOINT):
            self.sync_in_background()

    def post_close(self) -> None:
        # After Composer's uploads and its loggers' close; Composer may close an engine twice: copy once.
        if self.closed or not self.started or dist.get_global_rank() != 0:
            return
        self.closed = True
        if not self.copying.last(lambda: self.send(self.changed_files()), timeout_s=self.close_wait_s):
            log.warning(
                "gave up copying the run folder to %s at close after %.0f s (S3 is not answering); the "
                "files stay in %s and a resumed run copies them",
                self.remote_dir, self.close_wait_s, self.local_dir,
            )  # fmt: skip


def write_text_file(path: str, text: str) -> None:
    """Rank 0 writes a small file in the local run folder."""
    if dist.get_global_rank() != 0:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    storage.write_bytes(path, text.encode())
