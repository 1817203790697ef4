"""Hold a lease on the dataset version this run streams, so `encode gc` keeps it (shared/leases.py).

Rank 0 writes the lease as soon as the run has pinned the version (`hold_now`: before the model is built
and a checkpoint loaded, minutes for SD2-base from S3, during which `encode gc` deleted a pinned version no
lease named yet; at FIT_START when nothing held it before), rewrites it at the first BATCH_END after each
LEASE_REFRESH_S of wall time (a clock check per step, at most one write per refresh period, no storage call
otherwise) and deletes it at FIT_END. A job that stops (to be resumed), hangs or dies stops refreshing, so
its lease expires LEASE_TTL_S after its last write and gc may reclaim the version then. A failed write (an
S3 hiccup) is logged and retried a minute later; it never stops training. Refreshes are written by a
background thread: during an S3 outage one write takes the client's retries (~30 s), once a minute, and
rank 0's steps waited for it while the other ranks waited in a collective.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from shared.leases import LEASE_REFRESH_S, LEASE_TTL_S, lease_name, remove_lease, write_lease
from shared.runtime.background import CLOSE_WAIT_S, BackgroundJob

log = logging.getLogger(__name__)

LEASE_RETRY_S = 60  # after a failed write, the next attempt waits this long (not one per step)


class DatasetLease(Callback):
    """Rank 0 keeps `<root>/_leases/<run>-<host>-<pid>.json` naming `version` fresh while the run trains."""

    def __init__(
        self,
        root: str,
        version: str,
        job: str,
        refresh_s: float = LEASE_REFRESH_S,
        ttl_s: float = LEASE_TTL_S,
        clock: Callable[[], float] = time.time,
        close_wait_s: float = CLOSE_WAIT_S,
    ) -> None:
        if ttl_s <= refresh_s:
            raise ValueError(f"lease ttl_s {ttl_s} must exceed refresh_s {refresh_s}, or it lapses between")
        self.root, self.version, self.job = root.rstrip("/") or root, version, job
        self.refresh_s, self.ttl_s, self.clock = refresh_s, ttl_s, clock
        self.name = lease_name(job)
        self.next_write: float | None = None  # None: not holding a lease
        self.writes = 0
        self.refreshing = BackgroundJob("refreshing the dataset lease")
        self.close_wait_s = close_wait_s  # for the release at FIT_END

    def hold_now(self) -> DatasetLease:
        """Rank 0 writes the lease now (it is pinned; nothing else of the run has started)."""
        if dist.get_global_rank() == 0:
            self._write()
        return self

    def fit_start(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() == 0 and self.next_write is None:  # not held since hold_now
            self._write()  # before the first step

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.next_write is not None and self.clock() >= self.next_write and not self.refreshing.busy():
            self.next_write = self.clock() + self.refresh_s  # no second refresh started behind this one
            self.refreshing.start(self._write)

    def fit_end(self, state: State, logger: Logger) -> None:
        # In the background too, waited for at most a close's wait: else it expires by itself.
        self.refreshing.last(self._release, timeout_s=self.close_wait_s)

    # No release at close: a stopped or crashed run (a requeue, a restart) keeps its lease until it expires,
    # so `encode gc` in the meantime leaves the version it resumes on (train/data/recorded.py).

    def _write(self) -> None:
        now = self.clock()
        try:
            write_lease(self.root, self.name, self.version, self.job, self.ttl_s, now)
        except OSError as err:
            log.warning(
                "could not write the dataset lease for %s (retrying in %d s): %s",
                self.root,
                LEASE_RETRY_S,
                err,
            )
            self.next_write = now + LEASE_RETRY_S
            return
        self.writes += 1
        self.next_write = now + self.refresh_s

    def _release(self) -> None:
        if self.next_write is None:
            return
        self.next_write = None
        try:
            remove_lease(self.root, self.name)
        except OSError as err:  # it expires by itself
            log.warning(
                "could not remove the dataset lease for %s (it expires on its own): %s", self.root, err
            )
