"""Child processes that end with the process that started them, also when it is killed with SIGKILL.

A DataLoader worker notices a dead parent only between samples (its watchdog checks the parent's pid while
it waits for the next index); one blocked on a full result queue when its parent is killed never gets
there and sits orphaned, holding its memory (seen: an encode worker of ~490 MB, still there minutes after
`kill -9` of its encode process). Linux can deliver SIGKILL to a child when its parent dies
(`prctl(PR_SET_PDEATHSIG)`); elsewhere this does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux prctl option: signal the child when its parent dies


def die_with_parent(*_: object) -> None:
    """In the child: SIGKILL when the thread that started it ends. Usable as a DataLoader's
    `worker_init_fn` (which passes the worker id) and as a subprocess's `preexec_fn`."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
