"""How `python -m train fit` ends, told to its supervisor via the control folder (shared/launch/control.py).

Light (no torch): train/cli.py imports it to record errors no restart can fix.
"""

from __future__ import annotations

import os
import re

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
    """Tell the supervisor why the ranks are stopping (`resumable`, `fatal` or `finished`); a no-op without
    one.

    Local rank 0 writes it for a decision every rank shares (each node's supervisor reads its own folder); a
    fatal error may be seen by any rank alone, so every rank that sees one writes it (the file is replaced
    atomically, the last writer wins).
    """
    folder = control.control_dir()
    if folder is None or not folder.is_dir():
        return
    control.write_json(folder / control.EXIT_FILE, {"state": state, "batch": batch, "message": message,
                                                     "rank": int(os.environ.get("RANK", "0"))})  # fmt: skip


def record_fatal(err: BaseException, state: str = "fatal") -> None:
    """`state`: fatal, finished (the run had reached max_duration: done if the launch restarted after a
    crash at the run's end, shared/launch/supervisor.py final_code), or outage (S3 failed as in an outage:
    the supervisor restarts without counting it a crash, once a step)."""
    record_exit(state, -1, f"{type(err).__name__}: {err}")


# What a collective raises on the ranks that are left when another rank dies or its node is lost: gloo's
# transport errors (RuntimeError "[.../gloo/transport/tcp/pair.cc:525] Read error [addr]: Connection reset by
# peer", or a timeout while a peer is stopped) and torch's distributed errors (NCCL's included).
_DIST_ERRORS = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
_GLOO_SOURCE = re.compile(r"^\[[^\]]*gloo[^\]]*\]\s*")


def _is_collective_failure(err: BaseException) -> bool:
    kind = type(err)
    if kind.__name__ in _DIST_ERRORS and kind.__module__.startswith("torch"):
        return True
    return isinstance(err, RuntimeError) and "/gloo/transport/" in str(err)


def peer_lost(err: BaseException) -> str | None:
    """One line for a rank whose collective failed because another rank is gone (killed, OOM, its node lost,
    stopped): the rank that died says why in its own lines and the supervisor says what it does next. Each
    surviving rank printed two full tracebacks (the collective's, then Composer's closing barrier's), so one
    dead rank of 256 buried its own cause under 255 x 2 of them. None: not that (or one process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    chain, seen = [], err
    while seen is not None and len(chain) < 8:  # the closing barrier's error, then the step's it interrupted
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    failed = next((each for each in chain if _is_collective_failure(each)), None)
    if failed is None:
        return None
    detail = _GLOO_SOURCE.sub("", next(iter(str(failed).strip().splitlines()), ""))
    rank = os.environ.get("RANK", "?")
    return (
        f"rank {rank}: a collective with the other ranks failed ({type(failed).__name__}: {detail}): another "
        "rank died or stopped answering; its own lines say why (SD_DEBUG=1 shows this rank's traceback)"
    )
