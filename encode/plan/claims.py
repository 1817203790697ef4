"""One live run per rank of an encode output: each `encode run` rank claims
`<output>/_claims/rank-<R>-of-<W>.json` before it loads a model, and holds it until it ends.

Two `encode run`s of one dataset at once (a second terminal, a cron job overlapping a slow run, an array
resubmitted while the first still runs) both encoded every partition and both published: for laion400m that
is the whole GPU bill twice, with two runs writing the same partition folders. Now the second stops before
it loads a model, naming the first.

Ranks of one run (torchrun's, a Slurm array's, or started by hand with RANK / WORLD_SIZE on several machines)
claim different files and run side by side. A rank is refused when a live claim of its own rank is another
run's (it would redo the same partitions), or when a live claim of another world size is there (its partitions
overlap every rank's). Restarts of the same launch, a claimant that is gone and a claim not renewed for
CLAIM_TTL_S are not refused (shared/claims.py). A rank whose claim another run took over while it stalled (a
frozen node, a SIGSTOP, an outage past the TTL) stops at its next renewal, naming the taker, so the two never
write the same partitions side by side; its finished partitions stay. Requests per rank: one LIST and a few
GETs at its start, a GET and a PUT every CLAIM_REFRESH_S, one GET and a DELETE at its end; a rank never reads
the claims of its own run's other ranks, so a 256-rank array costs 256 times one rank, not 256 squared.
A rank killed -9 (or its node lost) leaves its claim behind: harmless once lapsed, and `encode gc` removes
those not renewed for twice the TTL (lapsed_claims).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

from shared import claims, storage
from shared.claims import SETTLE_S, Claim, ClaimLost, Renewal, this_claim
from shared.manifest import Layout

log = logging.getLogger("encode")

CLAIM_REFRESH_S = 120.0
CLAIM_TTL_S = 600.0  # five renewals: a few slow or failed writes (an S3 hiccup) never lapse a live claim
CLAIM_NAME = re.compile(r"rank-(\d{5,})-of-(\d{5,})\.json")


class OutputInUseError(RuntimeError):
    """Another live encode writes this output's partitions; the message names it and the ways on."""


def ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def claim_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.json"


def conflicting_claims(layout: Layout, rank: int, world_size: int) -> list[tuple[str, int, int]]:
    """(uri, rank, world size) of the claims that could guard this rank's partitions: its own rank's, and
    every claim of another world size. Names encode did not write are ignored."""
    found = []
    for info in storage.list_files(layout.claims_dir()):
        match = CLAIM_NAME.fullmatch(info.uri.rsplit("/", 1)[-1])
        if match is None:
            continue
        their_rank, their_world = int(match[1]), int(match[2])
        if their_world != world_size or their_rank == rank:
            found.append((info.uri, their_rank, their_world))
    return found


def refuse_if_taken(layout: Layout, rank: int, world_size: int, mine: Claim, settled: bool = False) -> None:
    """Stop (OutputInUseError) when a conflicting claim is another live run's. `settled`: after this rank
    wrote its own claim (its own file is then skipped; a write of the same file is judged by reading back)."""
    now = time.time()
    for uri, their_rank, their_world in conflicting_claims(layout, rank, world_size):
        if settled and their_rank == rank and their_world == world_size:
            continue
        claim = claims.read_claim(uri)
        taken = None if claim is None else claims.why_taken(claim, mine, now, CLAIM_TTL_S)
        if claim is None or taken is None:
            continue
        if their_world == world_size:
            who = f"another encode ({claim.run_name}) is encoding rank {rank} of {world_size} into"
        else:
            who = (
                f"another encode ({claim.run_name}) over {ranks(their_world)} (its rank {their_rank}) is "
                f"encoding partitions this one over {ranks(world_size)} would redo, in"
            )
        raise OutputInUseError(
            f"{who} output.uri {layout.root}: {taken}. Wait for it to end or stop it; to encode beside it, "
            f"give this run its own output.uri=. A claim whose run is gone lapses {CLAIM_TTL_S:.0f} s after "
            f"its last renewal (or remove {uri})"
        )


def take_rank_claim(layout: Layout, rank: int, world_size: int, run_name: str, settle_s: float) -> Claim:
    mine = this_claim(run_name)
    refuse_if_taken(layout, rank, world_size, mine)
    uri = storage.join(layout.claims_dir(), claim_name(rank, world_size))
    stayed, back = claims.write_and_read_back(uri, mine, settle_s)
    if not stayed:
        other = "another encode" if back is None else f"{back.run_name} (host {back.host}, pid {back.pid})"
        raise OutputInUseError(
            f"{other} started rank {rank} of {world_size} into output.uri {layout.root} at the same time as "
            "this one: stop one of them, or give each its own output.uri="
        )
    try:  # a run of another world size that wrote its claims at the same instant: both stop
        refuse_if_taken(layout, rank, world_size, mine, settled=True)
    except OutputInUseError:
        release(uri, mine)
        raise
    return mine


def lapsed_claims(layout: Layout, now: float, older_than_s: float = 2 * CLAIM_TTL_S) -> list[str]:
    """Claims (by encode's naming) not renewed for `older_than_s`: their ranks were killed or lost. A
    damaged one counts by its file's time. A claimant that was only stalled writes its claim again at its
    next renewal (shared/claims.py renew), so removing one never lets two runs share a rank."""
    lapsed = []
    for info in storage.list_files(layout.claims_dir()):
        if CLAIM_NAME.fullmatch(info.uri.rsplit("/", 1)[-1]) is None:
            continue
        claim = claims.read_claim(info.uri)
        written = info.modified if claim is None else claim.written
        if now - written > older_than_s:
            lapsed.append(info.uri)
    return lapsed


def release(uri: str, mine: Claim) -> None:
    try:
        claims.release_if_mine(uri, mine)
    except OSError as err:
        log.warning("could not release the claim %s (it lapses by itself): %s", uri, err)


@contextmanager
def claimed_rank(
    layout: Layout, rank: int, world_size: int, run_name: str, settle_s: float = SETTLE_S
) -> Iterator[Claim]:
    """Hold this rank's claim on `layout` while the block runs (renewed in the background, released after)."""
    mine = take_rank_claim(layout, rank, world_size, run_name, settle_s)
    uri = storage.join(layout.claims_dir(), claim_name(rank, world_size))
    renewal = Renewal(uri, mine, CLAIM_REFRESH_S)
    try:
        with renewal:
            yield mine
    except ClaimLost:
        raise OutputInUseError(taken_over(layout, rank, world_size, renewal.lost)) from None
    finally:
        release(uri, mine)


def taken_over(layout: Layout, rank: int, world_size: int, taker: Claim | None) -> str:
    who = "another encode" if taker is None else f"{taker.run_name} (host {taker.host}, pid {taker.pid})"
    return (
        f"{who} took over rank {rank} of {world_size} of output.uri {layout.root} (a claim is taken over "
        f"once it has gone {CLAIM_TTL_S:.0f} s without a renewal: this process was stopped or frozen, or "
        "could not reach the output; or by a restart of the same launch). This run stopped so that the two "
        "do not write the same partitions; the partitions it finished are kept, and the other run encodes "
        "the rest"
    )
