"""Child processes that end with the process that started them, also when it is killed with SIGKILL.

A DataLoader worker notices a dead parent only between samples (its watchdog checks the parent's pid while
it waits for the next index); one blocked on a full result queue when its parent is killed never gets
there and sits orphaned, holding its memory (seen: an encode worker of ~490 MB, still there minutes after
`kill -9` of its encode process). Linux can deliver SIGKILL to a child when its parent dies
(`prctl(PR_SET_PDEATHSIG)`); elsewhere this does nothing.

A training rank's loader workers also leave the rank's stop signals to the rank (`rank_loader_worker`), and
`worker_handover_problem` says when the temp folder is too long for the sockets they hand tensors over by.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import tempfile
import threading

PR_SET_PDEATHSIG = 1  # linux prctl option: signal the child when its parent dies
# The signals a training rank saves on and stops (train/resilience/monitor.py): Slurm's preemption, scancel
# and time limit, Kubernetes' eviction, the --signal warning.
RANK_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path holds 108 with the closing NUL)
# The socket multiprocessing opens to hand a worker's tensor (its file descriptor) to this process:
# <temp folder>/pymp-<8>/listener-<8>
_HANDOVER_SOCKET = len("/pymp-12345678/listener-12345678")


def die_with_parent(*_: object) -> None:
    """In the child: SIGKILL when the thread that started it ends. Usable as a DataLoader's
    `worker_init_fn` (which passes the worker id) and as a subprocess's `preexec_fn`."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def rank_loader_worker(*_: object) -> None:
    """In a DataLoader worker of a training rank (its `worker_init_fn`): dies with the rank
    (`die_with_parent`), and leaves the rank's stop signals to the rank unless the rank itself sends one.

    Slurm signals every process of a job step at a preemption, a scancel or the time limit: the workers died
    of that SIGTERM, and the rank's next batch failed ("DataLoader worker ... is killed by signal:
    Terminated"), a crash with a traceback instead of saving the step and exiting resumable. Ignoring the
    signals outright hung the rank's exit instead: Python's multiprocessing ends live workers at exit with
    SIGTERM and then waits for them (torch's last resort is SIGTERM too). So the signals are blocked, and
    one thread takes them with their sender: the rank's ends the worker, anyone else's is dropped."""
    die_with_parent()
    if not hasattr(signal, "sigwaitinfo"):  # not Linux: the default actions stay
        return
    rank = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, RANK_STOP_SIGNALS)  # every thread started after this one too
    threading.Thread(target=_end_on_the_ranks_signal, args=(rank,), daemon=True, name="rank-signals").start()


def _end_on_the_ranks_signal(rank: int) -> None:
    while True:
        got = signal.sigwaitinfo(set(RANK_STOP_SIGNALS))
        if got.si_pid == rank:
            os._exit(128 + got.si_signo)  # what the default action would have done, as an exit code


def worker_handover_problem(off_switch: str) -> str | None:
    """Why DataLoader workers could not hand their torch tensors to this process here; None when they can.

    torch shares a worker's tensor by its file descriptor, sent through a Unix socket in the temp folder, and
    a socket's path may not exceed 107 bytes: with a longer TMPDIR the worker's send failed in a background
    thread that only printed its traceback, and the process waited for that batch forever (a hang, not an
    error). Batches of numpy arrays and bytes (encode's) go through the pipe, and are not affected.
    `off_switch` names the setting that runs without workers."""
    folder = tempfile.gettempdir()
    size, room = len(os.fsencode(folder)), SOCKET_PATH_MAX - _HANDOVER_SOCKET
    if size <= room:
        return None
    return (
        f"the temp folder {folder} ({size} bytes) is too long for the Unix sockets loader "
        f"workers hand their batches over by (at most {room} bytes): set TMPDIR to a shorter folder "
        f"(e.g. TMPDIR=/tmp), or {off_switch}"
    )
