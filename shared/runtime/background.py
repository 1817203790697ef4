"""Best-effort work off a training loop's thread that never holds up the process's exit.

The run folder's copy to S3, the dataset lease's refresh and checkpoint pruning are each a few storage calls
that must not stop training when they fail. On their thread pools, during an S3 outage, each call took the
client's retries (~30 s seen, minutes at worst) and the pool's thread was joined at exit: a rank that was
ending on the outage sat in its close for as long (the supervisor's restart waited on it, and a test's run
never ended). Here each runs in a daemon thread, one at a time, and a close waits for it only so long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 30.0  # what a closing run gives each last copy / prune: seconds, unless S3 is not answering


def answer_within(timeout_s: float, task: Callable[..., Any], *args: Any) -> Any:
    """`task(*args)`'s result if it answers within `timeout_s`, else None; an exception counts as no answer
    (a storage read during an outage). The task's daemon thread is left to finish or die with the process."""
    result: list[Any] = []
    job = BackgroundJob(getattr(task, "__name__", "a task"))
    job.start(lambda: result.append(task(*args)))
    job.finish(timeout_s)
    return result[0] if result else None


class BackgroundJob:
    """One daemon thread at a time for a best-effort task."""

    def __init__(self, name: str):
        self.name = name
        self.thread: threading.Thread | None = None

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, task: Callable[..., Any], *args: Any) -> bool:
        """Run `task(*args)` in the background; False (nothing started) while the last one still runs."""
        if self.busy():
            return False
        self.thread = threading.Thread(target=self._run, args=(task, *args), name=self.name, daemon=True)
        self.thread.start()
        return True

    def finish(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Wait for the task in flight for at most `timeout_s`; whether none is left running."""
        if self.thread is not None:
            self.thread.join(max(0.0, timeout_s))
        return not self.busy()

    def last(self, task: Callable[..., Any], *args: Any, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """At close: wait for the task in flight, then run `task(*args)`, all within `timeout_s`; whether it
        ran to its end (False: it was given up, its thread left to die with the process)."""
        ends = time.monotonic() + timeout_s
        if not self.finish(timeout_s) or not self.start(task, *args):
            return False
        return self.finish(ends - time.monotonic())

    def _run(self, task: Callable[..., Any], *args: Any) -> None:
        try:
            task(*args)
        except Exception as err:  # best effort: the task's caller said it may fail; never a thread traceback
            log.warning("%s failed: %s", self.name, err)
