"""Save and stop at a step boundary, every rank together; heartbeats; a wall-clock save cadence.

What runs when, inside Composer's batch (callbacks run in list order; Composer appends its CheckpointSaver
after the job's callbacks, and `StopAfterSave` is appended after that, train/loop/trainer.py):
1. BATCH_END, `ResilienceMonitor`: writes this rank's heartbeat, then one all-reduce (MAX, over gloo in host
   memory, so no host-device sync) of three flags:
   a stop was asked for (a SIGTERM / SIGUSR1 reached this rank, or the supervisor's `stop` file exists), the
   deadline has passed ($SD_DEADLINE, rank 0's clock), a wall-clock save is due (rank 0's clock), another
   run took the save folder over (rank 0's claim, train/checkpoints/owner.py: every rank raises
   SaveFolderTakenError here, before anything is saved). Per-rank signal handlers only set a flag; the
   decision is the all-reduced one, so every rank saves the same step. When this step saves (the batch
   interval or that decision; EPOCH_END likewise for an interval in epochs), rank 0 first reads the save
   folder's claim and a second all-reduce carries the answer (`confirm_before_save`): renewals come every 2
   minutes, and a run back from a stall with a save due wrote it into the folder of the run that took over.
2. BATCH_CHECKPOINT, Composer's CheckpointSaver: its save_interval is the monitor itself, true on the batch
   interval (`save_interval`) or when step 1 decided to save.
3. BATCH_CHECKPOINT, `StopAfterSave`: records what was saved (progress.json), and after a stop decision
   records `resumable` and raises ResumableStop (the CLI exits 75; rerunning resumes from this step).
After the first step the collectives' timeout drops from Composer's 300 s (which also covers start-up) to
`resilience.collective_timeout_s`, so a stuck collective fails in minutes.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import torch
from composer.core import Callback, Event, State, TimeUnit
from composer.loggers import Logger
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler

from shared.launch import control
from shared.runtime.children import RANK_STOP_SIGNALS
from train.checkpoints.files import checkpoint_location
from train.checkpoints.owner import SaveFolderOwner, SaveFolderTakenError
from train.resilience.exits import ResumableStop, record_exit
from train.resilience.signals import restore

log = logging.getLogger(__name__)

STOP_SIGNALS = RANK_STOP_SIGNALS  # its loader workers leave them to it (shared/runtime/children.py)
# Until the trainer has closed (the last uploads, the last copies, Composer's closing barrier, which waits
# for the slowest rank's), a finished rank's heartbeat is rewritten this often: the supervisor takes a
# finished heartbeat older than hang_timeout_s for a teardown that never ends (a process group's destroy).
CLOSING_BEAT_S = 10.0
# A failure drill: "RANK:BATCH" SIGKILLs that global rank right after it completes that batch, every time the
# run passes it (rehearse the restart and crash-loop paths on a real cluster; the tests use it too).
FAULT_DRILL_ENV = "SD_FAULT_DRILL"


def fault_drill() -> tuple[int, int] | None:
    value = os.environ.get(FAULT_DRILL_ENV)
    if not value:
        return None
    rank, batch = value.split(":")
    return int(rank), int(batch)


class ResilienceMonitor(Callback):
    """The step-boundary decision (see module doc); also the CheckpointSaver's save_interval."""

    def __init__(
        self,
        save_interval: str,
        save_interval_minutes: float | None,
        collective_timeout_s: float,
        closing_s: float = 0.0,
        owner: SaveFolderOwner | None = None,
    ):
        """`closing_s`: for how long at most the heartbeat says "closing" after training ended
        (resilience.outage_patience_s, which each upload may wait, plus hang_timeout_s); past it, or
        hang_timeout_s after the trainer closed, a rank that has not exited is a hang. `owner`: the save
        folder's claim (held by rank 0), whose loss stops the run."""
        self.batch_due = create_interval_scheduler(save_interval, include_end_of_training=True)
        # The same schedule, asked one event ahead (whether this step or epoch saves) by confirm_before_save:
        # an instance of its own, so that asking early leaves the saver's answers as they were.
        self.save_ahead = create_interval_scheduler(save_interval, include_end_of_training=True)
        self.save_every_s = None if save_interval_minutes is None else save_interval_minutes * 60.0
        self.collective_timeout_s = collective_timeout_s
        self.folder = control.control_dir()
        self.deadline = control.deadline()
        self.signalled: str | None = None
        self.save_now = False
        self.stop_reason: str | None = None
        self.last_save = time.monotonic()
        self.tightened = False
        self.drill = fault_drill()
        # The flags live in host memory (numpy, viewed as a tensor for the all-reduce): reading them is no
        # host-device sync, so the step stays free of them (tests/train/loop/test_step_syncs.py).
        self.flags = np.zeros(4, dtype=np.int32)
        self.owner = owner
        self.flag_view = torch.from_numpy(self.flags)
        self.taken_flag = np.zeros(1, dtype=np.int32)  # confirm_before_save's all-reduce
        self.taken_view = torch.from_numpy(self.taken_flag)
        self.group: Any = None
        self.saved_handlers: dict[signal.Signals, Any] = {}
        self.closing_s = closing_s
        self.closed = threading.Event()  # set once the trainer has closed (train/loop/trainer.py)

    # ------------------------------------------------------------------------------------------ signals
    def fit_start(self, state: State, logger: Logger) -> None:
        # Replaces Composer's handler (sys.exit on SIGTERM, composer/core/engine.py): a signal only sets a
        # flag, acted on at the step boundary by every rank at once. Put back at close (fit returned or
        # raised; Composer's trainer.close() calls it), so the process answers SIGTERM again (signals.py).
        self.saved_handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        self.last_save = time.monotonic()
        self.group = flag_group()

    def fit_end(self, state: State, logger: Logger) -> None:
        # Training is over: the last checkpoint's upload that follows may take longer than hang_timeout_s
        # (an outage is waited out), and is not a hang; what comes after it (Composer's barrier, the process
        # group's teardown) must end within hang_timeout_s.
        self.finished(int(state.timestamp.batch))

    def finished(self, batch: int) -> None:
        """Say "training ended" in this rank's heartbeat, kept fresh until the trainer has closed (see
        __init__)."""
        if self.folder is None:
            return
        rank = dist.get_global_rank()
        control.write_heartbeat(self.folder, rank, batch, finished=True)
        if self.closing_s > 0:
            args = (self.folder, rank, batch, self.closed, self.closing_s)
            threading.Thread(target=beat_until_closed, args=args, daemon=True, name="closing-beat").start()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = signal.Signals(signum).name

    def close(self, state: State, logger: Logger) -> None:
        restore(self.saved_handlers)
        self.saved_handlers = {}

    # ------------------------------------------------------------------------------------- the decision
    def batch_end(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        if self.folder is not None:
            control.write_heartbeat(self.folder, dist.get_global_rank(), batch)
        if self.drill == (dist.get_global_rank(), batch):
            log.warning("%s: killing rank %d after batch %d", FAULT_DRILL_ENV, *self.drill)
            os.kill(os.getpid(), signal.SIGKILL)
        stop_file = self.folder is not None and control.stop_requested(self.folder)
        rank0 = dist.get_global_rank() == 0
        clock_due = self.save_every_s is not None and time.monotonic() - self.last_save >= self.save_every_s
        self.flags[:] = (
            int(self.signalled is not None or stop_file),
            int(rank0 and self.deadline is not None and time.time() >= self.deadline),
            int(rank0 and clock_due),
            int(self.owner is not None and self.owner.lost is not None),
        )
        if self.group is not None:
            torch.distributed.all_reduce(self.flag_view, op=torch.distributed.ReduceOp.MAX, group=self.group)
        asked, late, clock_save, taken = (bool(v) for v in self.flags)
        if taken:  # before BATCH_CHECKPOINT: nothing of this run lands in the other's folder any more
            self.stop_taken(batch)
        self.stop_reason = "a stop signal" if asked else "the deadline" if late else None
        if self.stop_reason and self.signalled:
            self.stop_reason = self.signalled
        self.save_now = bool(self.stop_reason) or clock_save
        if self.save_now or self.save_ahead(state, Event.BATCH_CHECKPOINT):
            self.confirm_before_save(batch)
        if self.stop_reason:
            log.warning("batch %d: saving and stopping (%s)", batch, self.stop_reason)
        if not self.tightened:  # after this run's first step (start-up and checkpoint loading are done)
            tighten_collective_timeout(self.collective_timeout_s)
            self.tightened = True

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.save_ahead(state, Event.EPOCH_CHECKPOINT):  # a save_interval in epochs
            self.confirm_before_save(int(state.timestamp.batch))

    def confirm_before_save(self, batch: int) -> None:
        """This step saves: rank 0 reads the save folder's claim (train/checkpoints/owner.py `confirm`, a GET
        that waits 10 s at most), and every rank stops here, before the save, if another run took the folder
        over. Every rank comes here at the same step (the save decision is the same on all), so the second
        all-reduce pairs up; steps that do not save have none."""
        if self.owner is None:
            return
        self.taken_flag[0] = int(not self.owner.confirm())
        if self.group is not None:
            torch.distributed.all_reduce(self.taken_view, op=torch.distributed.ReduceOp.MAX, group=self.group)
        if self.taken_flag[0]:
            self.stop_taken(batch)

    def stop_taken(self, batch: int) -> None:
        """Another run took the save folder over: every rank stops before saving (rank 0's message names
        the taker; the others say less)."""
        self.finished(batch)
        raise SaveFolderTakenError(
            self.owner.taken_over()
            if self.owner is not None and self.owner.lost is not None
            else "another run took over this run's save folder (rank 0 names it): stopped without saving"
        )

    def __call__(self, state: State, event: Event) -> bool:
        """CheckpointSaver's schedule: the batch interval, or a save decided at this step's boundary."""
        return bool(self.batch_due(state, event)) or (event == Event.BATCH_CHECKPOINT and self.save_now)


class StopAfterSave(Callback):
    """After Composer's CheckpointSaver: progress.json, and the stop itself (see module doc)."""

    def __init__(self, monitor: ResilienceMonitor, saver: Any, save_folder: str):
        self.monitor, self.saver, self.save_folder = monitor, saver, save_folder
        # progress.json: the last save, and for an s3:// save folder the last one known to be there. A
        # crash while a save uploads resumes from the one before (the supervisor had named the one saved).
        self.progress: dict[str, Any] = {}
        self.uploading = False

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        saved = self.saver is not None and self.saver.last_checkpoint_batch == state.timestamp.batch
        checkpoint = None
        if saved:
            sharded = state.fsdp_sharded_state_dict_enabled
            checkpoint = checkpoint_location(self.save_folder, int(state.timestamp.epoch), batch, sharded)
            self.monitor.last_save = time.monotonic()
            self.progress.update(saved_batch=batch, checkpoint=checkpoint)
            self.uploading = uploads_of(self.saver) is not None
            self.write_progress()
        elif self.uploading and uploads_done(self.saver):
            self.uploading = False
            self.write_progress()
        reason = self.monitor.stop_reason
        if reason is None or at_end(state):  # the last step: saved, and the run ends by itself
            return
        stop = ResumableStop(batch, reason, checkpoint)
        self.monitor.finished(batch)  # no more steps: the upload below is not a hang
        finish_uploads(self.saver, state, logger)
        if dist.get_local_rank() == 0:
            record_exit("resumable", batch, str(stop))
        raise stop

    def write_progress(self) -> None:
        """progress.json for this node's supervisor (local rank 0 of each node)."""
        folder = self.monitor.folder
        if folder is None or dist.get_local_rank() != 0:
            return
        if not self.uploading and uploads_of(self.saver) is not None:
            self.progress.update(uploaded_batch=self.progress["saved_batch"])
            self.progress.update(uploaded_checkpoint=self.progress["checkpoint"])
        control.write_json(folder / control.PROGRESS_FILE, self.progress)


def beat_until_closed(folder: Any, rank: int, batch: int, closed: threading.Event, limit_s: float) -> None:
    """Rewrite the finished heartbeat every CLOSING_BEAT_S until `closed` is set, for at most `limit_s` (a
    thread of the closing rank; the control folder may be gone once the supervisor ends)."""
    ends = time.monotonic() + limit_s
    while not closed.wait(CLOSING_BEAT_S) and time.monotonic() < ends:
        with contextlib.suppress(OSError):
            control.write_heartbeat(folder, rank, batch, finished=True)


def uploads_of(saver: Any) -> Any:
    """The CheckpointSaver's uploader (an s3:// save folder), or None."""
    return getattr(saver, "remote_uploader", None)


def uploads_done(saver: Any) -> bool:
    """Whether this rank's checkpoint files and the `latest` pointer of its saves are all in S3: Composer's
    uploader drops each finished upload at BATCH_END (this runs at BATCH_CHECKPOINT, after it), and the
    pointer's upload waits in symlink_upload_tasks until the files are there."""
    uploader = uploads_of(saver)
    return uploader is None or (not uploader.futures and not getattr(saver, "symlink_upload_tasks", []))


def finish_uploads(saver: Any, state: State, logger: Logger) -> None:
    """An s3:// save folder: wait until this save is uploaded and write its `latest` pointer, as Composer's
    CheckpointSaver does at FIT_END, which a stop never reaches (a SIGTERM with an s3:// save_folder left
    no `latest`, so the rerun would not have resumed from the step just saved; seen in the two-node test)."""
    if saver is not None and getattr(saver, "remote_uploader", None) is not None:
        saver.fit_end(state, logger)


def at_end(state: State) -> bool:
    """Whether the step just taken is the run's last (at BATCH_CHECKPOINT)."""
    duration = state.max_duration
    if duration is None:
        return False
    if state.timestamp.get(duration.unit) >= duration:
        return True
    # In epochs: the counter moves only after BATCH_CHECKPOINT, when the loader is done; the last epoch's
    # last batch is the end already (a stop there exited 75 for a run with nothing left to train).
    stamp, batches = state.timestamp, state.dataloader_len
    return (
        duration.unit == TimeUnit.EPOCH
        and batches is not None
        and int(stamp.epoch) + 1 >= duration.value
        and int(stamp.batch_in_epoch) >= int(batches)
    )


def flag_group() -> Any:
    """The process group the stop flags are all-reduced over: a host-memory (gloo) one. The default group
    under gloo (CPU ranks); a gloo group beside NCCL on GPUs. None on a single process."""
    tdist = torch.distributed
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() < 2:
        return None
    if tdist.get_backend() == "gloo":
        return tdist.group.WORLD
    return tdist.new_group(backend="gloo")  # every rank runs FIT_START, so every rank joins


def tighten_collective_timeout(seconds: float) -> None:
    """Collectives of the default group time out after `seconds` from now on (no-op on one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    try:
        _set_pg_timeout(datetime.timedelta(seconds=seconds))
    except (RuntimeError, ValueError, AttributeError) as err:  # a backend without per-group timeouts
        log.warning("could not set the collective timeout to %g s: %s", seconds, err)


def find_saver(callbacks: list[Any]) -> Any:
    from composer.callbacks import CheckpointSaver

    return next((cb for cb in callbacks if isinstance(cb, CheckpointSaver)), None)
