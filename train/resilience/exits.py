"""How `python -m train fit` ends, told to its supervisor via the control folder (shared/launch/control.py).

Light (no torch): train/cli.py imports it to record errors no restart can fix.
"""

from __future__ import annotations

import os

from shared.launch import control


class ResumableStop(Exception):
    """Saved the current step and stopped on purpose (a signal or a deadline): rerun to resume."""

    def __init__(self, batch: int, reason: str, checkpoint: str | None):
        self.batch, self.reason, self.checkpoint = batch, reason, checkpoint
        where = f" ({checkpoint})" if checkpoint else ""
        super().__init__(
            f"stopped at batch {batch} on {reason} after saving a checkpoint of it{where}; rerun the same "
            f"command to resume (exit code {control.EXIT_RESUMABLE})"
        )


def resumable_exit_code() -> int:
    """75 for a run started by hand; 0 under a supervisor, which reads the `resumable` record and exits 75
    itself: torchrun's elastic agent restarts ranks that exit non-zero, and a stop must not restart."""
    return control.EXIT_RESUMABLE if control.control_dir() is None else control.EXIT_DONE


def record_exit(state: str, batch: int, message: str) -> None:
    """Tell the supervisor why the ranks are stopping (`resumable` or `fatal`); a no-op without one.

    Local rank 0 writes it for a decision every rank shares (each node's supervisor reads its own folder); a
    fatal error may be seen by any rank alone, so every rank that sees one writes it (the file is replaced
    atomically, the last writer wins).
    """
    folder = control.control_dir()
    if folder is None or not folder.is_dir():
        return
    control.write_json(folder / control.EXIT_FILE, {"state": state, "batch": batch, "message": message,
                                                     "rank": int(os.environ.get("RANK", "0"))})  # fmt: skip


def record_fatal(err: BaseException) -> None:
    record_exit("fatal", -1, f"{type(err).__name__}: {err}")
