"""One live run per rank of an encode output (encode/plan/claims.py): a second `encode run` of the same ranks,
or of another world size, stops before it loads a model; the ranks of one run, its restarts, a claimant
that is gone and a lapsed claim do not."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from encode.plan import claims as encode_claims
from encode.plan.claims import CLAIM_TTL_S, OutputInUseError, claim_name, claimed_rank
from encode.sample_data import build_webdataset
from shared import claims, storage
from shared.claims import Claim, this_claim
from shared.launch import control
from shared.manifest import Layout
from tests.encode.test_cli import START_TIMEOUT_S, encode_cmd
from tests.encode.test_pipeline import LOW, rows_by_key

REFUSAL_TIMEOUT_S = 120  # importing the CLI's modules and one LIST on a loaded 2-core box


@pytest.fixture
def live_pid() -> Iterator[int]:
    """A process that runs for the test: a live claimant on this host."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def plant(layout: Layout, rank: int, world: int, claim: Claim) -> str:
    uri = storage.join(layout.claims_dir(), claim_name(rank, world))
    claims.write_claim(uri, claim)
    return uri


def live_claim(pid: int, **changes: object) -> Claim:
    claim = replace(this_claim("encode other"), pid=pid, start=control.process_start(pid) or 0, launch="")
    return replace(claim, **changes)  # type: ignore[arg-type]


def refused(layout: Layout, rank: int, world: int) -> str | None:
    """The refusal's message for `rank` of `world`, or None when it may run (then its claim is released)."""
    try:
        with claimed_rank(layout, rank, world, "encode mine", settle_s=0.0):
            pass
    except OutputInUseError as err:
        return str(err)
    return None


@pytest.mark.parametrize("where", ["local", "s3"])
def test_who_may_encode_beside_a_live_claim(
    where: str, tmp_path: Path, live_pid: int, request: pytest.FixtureRequest
) -> None:
    root = request.getfixturevalue("s3_prefix") if where == "s3" else str(tmp_path / "out")
    layout = Layout(root)
    sibling = plant(layout, 1, 2, live_claim(live_pid))  # rank 1 of a live 2-rank run

    assert refused(layout, 0, 2) is None, "another rank of the same world size runs beside it"
    own = plant(layout, 0, 2, live_claim(live_pid))
    message = refused(layout, 0, 2) or ""
    assert f"encoding rank 0 of 2 into output.uri {root}: pid {live_pid} on this host" in message
    assert "give this run its own output.uri=" in message and own in message
    assert claims.read_claim(own) == live_claim(live_pid, written=claims.read_claim(own).written)  # type: ignore[union-attr]

    message = refused(layout, 0, 1) or ""  # one rank would redo the 2-rank run's partitions
    assert "over 2 ranks (its rank" in message and "this one over 1 rank would redo" in message

    storage.delete(own)
    storage.delete(sibling)
    far = live_claim(live_pid, host="node-7", written=time.time() - 30)
    plant(layout, 0, 1, far)
    assert "a process on host node-7" in (refused(layout, 0, 1) or ""), "another host, renewed 30 s ago"
    plant(layout, 0, 1, replace(far, written=time.time() - CLAIM_TTL_S - 5))
    assert refused(layout, 0, 1) is None, "a claim not renewed for its TTL has lapsed"

    plant(layout, 0, 1, replace(far, launch="slurm:4242"))
    os.environ["SLURM_ARRAY_JOB_ID"] = "4242"
    try:
        assert refused(layout, 0, 1) is None, "a requeued array task: the same launch"
    finally:
        del os.environ["SLURM_ARRAY_JOB_ID"]

    ended = subprocess.Popen(["true"])
    ended.wait()
    plant(layout, 0, 1, live_claim(ended.pid))
    assert refused(layout, 0, 1) is None, "a claimant that is gone (kill -9, a crash)"
    assert not any(storage.list_files(layout.claims_dir())), "each run that ran released its own claim"


def test_the_claim_is_renewed_and_a_release_leaves_a_claim_that_is_not_its_own(
    tmp_path: Path, live_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout(str(tmp_path / "out"))
    uri = storage.join(layout.claims_dir(), claim_name(0, 1))
    monkeypatch.setattr(encode_claims, "CLAIM_REFRESH_S", 0.05)
    with claimed_rank(layout, 0, 1, "encode mine", settle_s=0.0) as mine:
        deadline = time.monotonic() + 30
        while (claims.read_claim(uri) or mine).written == mine.written:
            assert time.monotonic() < deadline, "the claim was not renewed"
            time.sleep(0.02)
    assert claims.read_claim(uri) is None, "released at the end"

    monkeypatch.setattr(encode_claims, "CLAIM_REFRESH_S", 3600.0)
    taker = live_claim(live_pid, host="node-7")
    with claimed_rank(layout, 0, 1, "encode mine", settle_s=0.0):
        claims.write_claim(uri, taker)  # another host took the claim over (this run stalled past its TTL)
    assert claims.read_claim(uri) == taker, "a release removes only this run's own claim"


def test_a_rank_whose_claim_was_taken_over_stops_and_leaves_the_takers_claim(
    tmp_path: Path, live_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that stalled past its TTL and was taken over by another host's run used to overwrite the
    taker's claim at its next renewal, and both encoded the same partitions. Now the renewal leaves it and
    the rank stops (ClaimLost in its main thread, wherever it is: here a sleep), naming the taker."""
    layout = Layout(str(tmp_path / "out"))
    uri = storage.join(layout.claims_dir(), claim_name(0, 1))
    monkeypatch.setattr(encode_claims, "CLAIM_REFRESH_S", 0.05)
    taker = live_claim(live_pid, host="node-7", run_name="encode theirs")
    with pytest.raises(OutputInUseError) as stopped, claimed_rank(layout, 0, 1, "encode mine", settle_s=0):
        claims.write_claim(uri, taker)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the partitions' work, until the loss interrupts it
            time.sleep(0.01)
    text = str(stopped.value)
    assert f"encode theirs (host node-7, pid {live_pid}) took over rank 0 of 1 of output.uri" in text, text
    assert "the partitions it finished are kept" in text
    assert claims.read_claim(uri) == taker, "the taker's claim was overwritten or released"


def test_a_renewal_rewrites_its_own_claim_and_leaves_anothers(tmp_path: Path) -> None:
    uri = str(tmp_path / "claim.json")
    mine = this_claim("mine")
    claims.write_claim(uri, replace(mine, written=1.0))
    assert claims.renew(uri, mine) is None
    assert (claims.read_claim(uri) or mine).written > 1.0
    storage.delete(uri)  # removed by hand: still this job's place
    assert claims.renew(uri, mine) is None and claims.read_claim(uri) is not None
    theirs = replace(mine, host="node-7", written=2.0)
    claims.write_claim(uri, theirs)
    assert claims.renew(uri, mine) == theirs and claims.read_claim(uri) == theirs


@pytest.mark.slow
def test_a_second_encode_of_a_running_one_stops_before_loading_models_and_the_first_finishes(
    tmp_path: Path,
) -> None:
    """The first run is held (SIGSTOP) once its claim is written, so the others meet it for certain: the
    same command, and a hand-started rank of another world size. Both exit 2 with one line naming the first
    run; the first then finishes as if alone."""
    src, out = tmp_path / "in", tmp_path / "out"
    build_webdataset(src, shards=2, per_shard=8, seed=11)
    layout = Layout(str(out))
    own = Path(layout.claims_dir()) / claim_name(0, 1)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    first = subprocess.Popen(encode_cmd(src, out), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not own.exists():
            assert first.poll() is None, "the first encode ended before it claimed its rank"
            assert time.monotonic() < deadline, "the first encode wrote no claim in time"
            time.sleep(0.02)
        os.kill(first.pid, signal.SIGSTOP)
        again = subprocess.run(encode_cmd(src, out), env=env, capture_output=True, timeout=REFUSAL_TIMEOUT_S)
        rank_1_of_2 = {**env, "RANK": "1", "WORLD_SIZE": "2"}
        other = subprocess.run(
            encode_cmd(src, out), env=rank_1_of_2, capture_output=True, timeout=REFUSAL_TIMEOUT_S
        )
    finally:
        os.kill(first.pid, signal.SIGCONT)
    output, _ = first.communicate(timeout=START_TIMEOUT_S)
    assert first.returncode == 0, output.decode()[-3000:]

    for proc, words in [(again, "is encoding rank 0 of 1 into"), (other, "over 1 rank (its rank 0)")]:
        err = proc.stderr.decode()
        assert proc.returncode == 2, err[-3000:]
        assert words in err and f"pid {first.pid} on this host" in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not proc.stdout.strip(), "it stopped before encoding anything"
    assert len(rows_by_key(out, LOW)) > 0  # each key once (rows_by_key asserts it)
    assert not any(Path(layout.claims_dir()).iterdir()), "the first run released its claim"
