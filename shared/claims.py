"""Claims: a live job's mark on work no other job may do beside it (train's save folder, encode's ranks).

A claim is one small JSON object (local or s3://): host, pid and process start, the launch, the job's name,
when it was written. A job may take a claim's place when there is none; when the claim is its own launch's
(a restart by the supervisor, torchrun's elastic agent or a Slurm requeue: the same launch id); when the
claiming process is gone (same host: its pid and start time); or when the claim has not been renewed for
its TTL (another host: a live claimant renews it well within that). Two jobs taking one place at the same
instant both write; each reads the claim back after a moment, and the one whose claim did not stay stops.
A renewal reads the claim before it rewrites it: a job that stalled past its TTL (a frozen node, a SIGSTOP,
an outage longer than the TTL) and was taken over finds the taker's claim there, leaves it, and stops; it
used to overwrite it, and the two ran on side by side, each sure the place was its own.

What the claim guards and what a refusal says is the caller's (train/checkpoints/owner.py,
encode/plan/claims.py); this module is the mechanism, torch- and Composer-free.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from shared import storage
from shared.launch import control

log = logging.getLogger(__name__)

SETTLE_S = 0.5  # before reading a fresh claim back: another job's write at the same instant lands by then
JOIN_S = 30.0  # what a renewal in flight gets at the end (an S3 write that is retrying)


@dataclass(frozen=True)
class Claim:
    host: str
    pid: int
    start: int  # the process's start (clock ticks since boot, shared/launch/control.py process_start)
    launch: str  # what stays the same across restarts of one launch ("" without one)
    run_name: str
    written: float  # unix seconds

    def same_owner(self, other: Claim) -> bool:
        return (self.host, self.pid, self.start) == (other.host, other.pid, other.start)

    def renewed(self) -> Claim:
        return replace(self, written=time.time())


def launch_id() -> str:
    """The id restarts of this launch share: the Slurm job (a requeue keeps it; an array's tasks share the
    array's), torchrun's rendezvous id on several nodes (the launcher's --rdzv-id: every node and every
    elastic restart), the supervisor's control folder on one (each restart runs a new torchrun, whose own id
    is new each time); "" otherwise."""
    if job := os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{job}"
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and (rdzv := os.environ.get("TORCHELASTIC_RUN_ID")):
        return f"rdzv:{rdzv}"
    if folder := control.control_dir():
        return f"supervisor:{socket.gethostname()}:{folder}"
    return ""


def this_claim(run_name: str) -> Claim:
    pid = os.getpid()
    return Claim(
        socket.gethostname(), pid, control.process_start(pid) or 0, launch_id(), run_name, time.time()
    )


def read_claim(uri: str) -> Claim | None:
    try:
        raw = storage.read_json(uri)
        return Claim(**{name: raw[name] for name in Claim.__dataclass_fields__})
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):  # damaged or written by something else: not a live claim
        return None


def write_claim(uri: str, claim: Claim) -> None:
    storage.write_json(uri, asdict(claim))


def why_taken(claim: Claim, mine: Claim, now: float, ttl_s: float) -> str | None:
    """Why `claim` keeps `mine` out, or None when `mine` may take its place."""
    if claim.same_owner(mine) or (claim.launch and claim.launch == mine.launch):
        return None
    if claim.host == mine.host:
        return f"pid {claim.pid} on this host" if control.is_running(claim.pid, claim.start) else None
    if now - claim.written > ttl_s:
        return None
    ago = now - claim.written
    return f"a process on host {claim.host} (pid {claim.pid}), which renewed its claim {ago:.0f} s ago"


def write_and_read_back(uri: str, mine: Claim, settle_s: float = SETTLE_S) -> tuple[bool, Claim | None]:
    """Write `mine` to `uri`, wait `settle_s`, read it back: (whether it stayed, what is there)."""
    write_claim(uri, mine)
    time.sleep(settle_s)
    back = read_claim(uri)
    return back is not None and back.same_owner(mine), back


def renew(uri: str, mine: Claim) -> Claim | None:
    """Rewrite `mine`, renewed, unless another job's claim has taken its place: then nothing is written and
    that claim is returned (the caller stops). No claim there (removed by hand) is rewritten. The read and
    the write are two requests: a taker that writes between them is overwritten, and its own next renewal
    finds this claim and stops, so one owner is left either way."""
    claim = read_claim(uri)
    if claim is not None and not claim.same_owner(mine):
        return claim
    write_claim(uri, mine.renewed())
    return None


def release_if_mine(uri: str, mine: Claim) -> None:
    """Remove the claim if it is still `mine` (a job that took over a lapsed claim keeps its own)."""
    claim = read_claim(uri)
    if claim is not None and claim.same_owner(mine):
        storage.delete(uri)


class ClaimLost(BaseException):  # an interruption, as KeyboardInterrupt is
    """Raised in the main thread of a job whose claim another job took over (Renewal); the holder of the
    Renewal turns it into its own refusal, naming the taker (`Renewal.lost`). A BaseException, so that no
    `except Exception` on the way (a partition's failure counted and skipped) takes it for the job's own."""


def raise_in_main_thread(kind: type[BaseException]) -> None:
    """Raise `kind` in the main thread at its next Python instruction. Not `_thread.interrupt_main()`: that
    runs the process's SIGINT handler, which is Composer's sys.exit in a process that imported it, and
    nothing at all where SIGINT is ignored (a job started in the background by a batch script)."""
    main = threading.main_thread().ident
    if main is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(kind))


class Renewal:
    """Renews a held claim every `every_s` from a daemon thread, for a job without a loop to hook (encode).
    A failed request is logged and tried again at the next period: the TTL outlasts several. When another
    job has taken the claim over, renewing stops, `lost` holds the taker's claim and ClaimLost is raised in
    the main thread, unless the block has ended."""

    def __init__(
        self,
        uri: str,
        mine: Claim,
        every_s: float,
        on_lost: Callable[[type[BaseException]], None] = raise_in_main_thread,
    ):
        self.uri, self.mine, self.every_s, self.on_lost = uri, mine, every_s, on_lost
        self.lost: Claim | None = None
        self.stopped = threading.Event()
        self.ending = threading.Lock()  # the block's end and a loss's interruption, one at a time
        self.thread = threading.Thread(target=self._run, name=f"renewing {uri}", daemon=True)

    def __enter__(self) -> Renewal:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop renewing; a write in flight gets `JOIN_S` to land, so a release after this one stays."""
        with self.ending:
            self.stopped.set()
        self.thread.join(JOIN_S)

    def _run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                taker = renew(self.uri, self.mine)
            except OSError as err:  # an S3 hiccup: the claim lasts its TTL, the next renewal comes first
                log.warning("could not renew the claim %s (trying again later): %s", self.uri, err)
                continue
            if taker is not None:
                self.lost = taker
                with self.ending:
                    if not self.stopped.is_set():
                        self.on_lost(ClaimLost)
                return
