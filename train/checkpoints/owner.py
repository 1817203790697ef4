"""One live run per save folder: rank 0 claims the folder at its start and keeps the claim while it trains.

Rerunning a live run's command (from another terminal, by a user who did not notice it was still running)
was refused only by the Streaming cache lock, whose message told the user to give the run its own
data.cache_dir; doing so resumed from the live run's latest checkpoint beside it: both exited 0 having
overwritten each other's checkpoints, `latest` and train_config.yaml, and metrics.jsonl held 47 of its 107
lines twice. With an s3:// save folder and a second host nothing refused at all.

The claim is `<save_folder>/.run-owner.json` (local or s3://): host, pid and process start, the launch, when
it was written. A run may take the folder when there is no claim; when the claim is its own launch's (a
restart by the supervisor, torchrun's elastic agent or a Slurm requeue: the same launch id); when the claiming
process is gone (same host: its pid and start time); or when the claim has not been renewed for OWNER_TTL_S
(another host: it renews every OWNER_REFRESH_S while it trains). Otherwise the run stops before it reads a
checkpoint, naming the claimant and how to go on. Released at close. A renewal reads the claim first: a run
that stalled past OWNER_TTL_S and was taken over (its rerun started elsewhere meanwhile) finds the taker's
claim, leaves it, and every rank stops at the next step boundary without saving (SaveFolderTakenError, exit 2,
no restart), so the taker's checkpoints and `latest` stay its own. Renewals come every OWNER_REFRESH_S, so
rank 0 also reads the claim at the boundary of every step that saves (`confirm`, train/resilience/monitor.py):
a run back from a stall with a save due wrote that save, and `latest`, into the taker's folder once before its
next renewal stopped it. Two runs starting at the same instant both write; each reads the claim back after a
moment, and the one whose claim did not stay stops. The claim itself (who may take it, writing, reading back,
releasing) is shared/claims.py's, which encode's rank claims use too.
"""

from __future__ import annotations

import logging
import time

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from shared import claims, storage
from shared.claims import SETTLE_S, Claim, this_claim
from shared.runtime.background import CLOSE_WAIT_S, BackgroundJob, answer_within

log = logging.getLogger(__name__)

OWNER_FILENAME = ".run-owner.json"
OWNER_REFRESH_S = 120.0
OWNER_TTL_S = 600.0  # five renewals: a few slow or failed writes (an S3 hiccup) never lapse a live claim
# What a save waits at most for the claim's read (`confirm`): an S3 GET is milliseconds; one that does not
# answer by then (an outage, which the upload waits out anyway) lets the save go ahead, as it always did.
CONFIRM_WAIT_S = 10.0


class SaveFolderInUseError(RuntimeError):
    """Another live run trains into this save folder; the message names it and the ways on."""


class SaveFolderTakenError(SaveFolderInUseError):
    """Another run took this run's save folder over while this one stalled: it stops without saving."""


def read_claim(save_folder: str) -> Claim | None:
    return claims.read_claim(storage.join(save_folder, OWNER_FILENAME))


def why_taken(claim: Claim, mine: Claim, now: float) -> str | None:
    """Why `claim` keeps this run out of the folder, or None when this run may take it."""
    return claims.why_taken(claim, mine, now, OWNER_TTL_S)


def claim_save_folder(
    save_folder: str, run_name: str, close_wait_s: float = CLOSE_WAIT_S, settle_s: float = SETTLE_S
) -> SaveFolderOwner:
    """Rank 0 claims `save_folder` for this run (see module doc); the callback that keeps and releases it
    (`close_wait_s`: what the release gets at close)."""
    owner = SaveFolderOwner(save_folder, run_name, close_wait_s)
    if dist.get_global_rank() == 0:
        owner.take(settle_s)
    return owner


class SaveFolderOwner(Callback):
    """Holds this run's claim: renewed every OWNER_REFRESH_S at a step's end (in the background), released
    after the trainer closed."""

    def __init__(self, save_folder: str, run_name: str, close_wait_s: float = CLOSE_WAIT_S):
        self.save_folder, self.run_name, self.close_wait_s = save_folder, run_name, close_wait_s
        self.uri = storage.join(save_folder, OWNER_FILENAME)
        self.mine: Claim | None = None
        self.lost: Claim | None = None  # the claim of the run that took the folder over (renew)
        self.next_renewal = 0.0
        self.renewing = BackgroundJob("renewing the save folder's claim")

    def take(self, settle_s: float) -> None:
        mine = this_claim(self.run_name)
        claim = claims.read_claim(self.uri)
        taken = None if claim is None else why_taken(claim, mine, time.time())
        if claim is not None and taken is not None:
            raise SaveFolderInUseError(
                f"another run ({claim.run_name}) is training into save_folder {self.save_folder}: {taken}. "
                "Wait for it to end or stop it; to train beside it, give this run its own save_folder=. A "
                f"claim whose run is gone lapses {OWNER_TTL_S:.0f} s after its last renewal (or remove "
                f"{self.uri})"
            )
        stayed, back = claims.write_and_read_back(self.uri, mine, settle_s)
        if not stayed:
            other = "another run" if back is None else f"{back.run_name} (host {back.host}, pid {back.pid})"
            raise SaveFolderInUseError(
                f"{other} started into save_folder {self.save_folder} at the same time as this one: stop one "
                "of them, or give each its own save_folder="
            )
        self.mine = mine
        self.next_renewal = time.monotonic() + OWNER_REFRESH_S

    def renew(self) -> None:
        mine = self.mine
        if mine is None:
            return
        try:
            taker = claims.renew(self.uri, mine)
        except OSError as err:  # an S3 hiccup: the claim lasts OWNER_TTL_S, the next renewal comes first
            log.warning("could not renew the claim on %s (trying again later): %s", self.save_folder, err)
            return
        if taker is not None:  # the monitor stops every rank at the next step boundary (monitor.py)
            self.lose_to(taker)

    def confirm(self, wait_s: float = CONFIRM_WAIT_S) -> bool:
        """Whether the folder is still this run's, read now (a save is due). False when another run's claim
        has taken this run's place: `lost` names it. A read that fails or does not answer within `wait_s`
        counts as still this run's (the renewals go on). True on ranks that hold no claim and lost none."""
        mine = self.mine
        if mine is None:
            return self.lost is None
        claim = answer_within(wait_s, claims.read_claim, self.uri)
        if claim is not None and not claim.same_owner(mine):
            self.lose_to(claim)
        return self.lost is None

    def lose_to(self, taker: Claim) -> None:
        """Another run's claim took this run's place: hold it no longer, and say so (rank 0's log)."""
        self.lost, self.mine = taker, None
        log.error("%s", self.taken_over())

    def taken_over(self) -> str:
        """The stop's message when another run has taken the folder over (rank 0's; the others say less)."""
        taker = self.lost
        who = "another run" if taker is None else f"{taker.run_name} (host {taker.host}, pid {taker.pid})"
        return (
            f"{who} took over save_folder {self.save_folder} (a claim is taken over once it has gone "
            f"{OWNER_TTL_S:.0f} s without a renewal: this process was stopped or frozen, or could not reach "
            "the folder; or by a restart of the same launch). This run stopped without saving, so the "
            "checkpoints and `latest` there are the other run's; to go on with this one, stop the other and "
            "rerun, or give this run its own save_folder="
        )

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.mine is not None and time.monotonic() >= self.next_renewal and not self.renewing.busy():
            self.next_renewal = time.monotonic() + OWNER_REFRESH_S
            self.renewing.start(self.renew)

    def release(self) -> None:
        """Remove the claim if it is still this run's (a run that took over a lapsed claim keeps its own)."""
        mine, self.mine = self.mine, None
        if mine is not None:
            claims.release_if_mine(self.uri, mine)

    def post_close(self) -> None:
        if self.mine is not None and not self.renewing.last(self.release, timeout_s=self.close_wait_s):
            log.warning("could not release the claim on %s at close; it lapses by itself", self.save_folder)

    def release_now(self) -> None:
        """Release the claim at once (a build that failed before the trainer, and so its close, existed)."""
        try:
            self.release()
        except OSError as err:
            log.warning("could not release the claim on %s: %s", self.save_folder, err)
