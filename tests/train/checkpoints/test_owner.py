"""One live run per save folder (train/checkpoints/owner.py): a second run into a live run's save folder is
refused before it reads a checkpoint; restarts, a dead claimant and a lapsed claim are not."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from shared import storage
from shared.claims import Claim
from shared.launch import control
from shared.runtime.exits import TORCHRUN_FAILED
from tests.train.conftest import (
    PYTHON,
    REPO_ROOT,
    TORCHRUN,
    job_env,
    single_threaded_torch,
    tiny_config,
    tiny_overrides,
)
from train.checkpoints import owner as owner_module
from train.checkpoints.files import LATEST_NAME
from train.checkpoints.owner import (
    OWNER_FILENAME,
    OWNER_TTL_S,
    SaveFolderInUseError,
    SaveFolderTakenError,
    claim_save_folder,
    read_claim,
    this_claim,
    why_taken,
)


def test_who_may_take_a_claimed_folder() -> None:
    mine = this_claim("run-b")
    now = time.time()
    live = subprocess.Popen(["sleep", "30"])
    done = subprocess.Popen(["true"])
    done.wait()
    try:
        live_claim = replace(mine, pid=live.pid, start=control.process_start(live.pid) or 0, launch="")
        assert why_taken(live_claim, mine, now) == f"pid {live.pid} on this host"
        assert why_taken(replace(live_claim, start=live_claim.start + 1), mine, now) is None  # a reused pid
        assert why_taken(replace(live_claim, pid=done.pid), mine, now) is None  # gone
        zombie = subprocess.Popen(["true"])  # exited, not reaped: a SIGKILLed rank torchrun has not reaped
        time.sleep(0.5)
        zombie_claim = replace(live_claim, pid=zombie.pid, start=control.process_start(zombie.pid) or 0)
        assert why_taken(zombie_claim, mine, now) is None
        zombie.wait()
        assert why_taken(mine, mine, now) is None  # this process (a second fit in one process)
        restart = replace(live_claim, launch="slurm:123")
        assert why_taken(restart, replace(mine, launch="slurm:123"), now) is None  # a requeue of the job
        other = replace(live_claim, host="node-7", written=now - 30)
        assert "host node-7" in (why_taken(other, mine, now) or "")
        assert why_taken(replace(other, written=now - OWNER_TTL_S - 1), mine, now) is None  # lapsed
    finally:
        live.kill()
        live.wait()


def plant_claim(save: Path, **fields: object) -> None:
    claim = {**asdict(this_claim("run-a")), "pid": 4_000_000, "start": 1, "launch": "", **fields}
    save.mkdir(parents=True, exist_ok=True)
    (save / OWNER_FILENAME).write_text(json.dumps(claim))


def take_over(save: Path) -> Claim:
    """Write another host's live claim (run-b, node-7) into `save`, as a run that took it over would; its
    claim."""
    taker = replace(this_claim("run-b"), host="node-7", pid=4_000_000, launch="")
    storage.write_json(str(save / OWNER_FILENAME), asdict(taker))
    return taker


def test_another_hosts_live_claim_refuses_and_a_lapsed_one_is_taken_over(
    tiny_dataset: str, tmp_path: Path
) -> None:
    from train.loop.trainer import fit

    save = tmp_path / "save"
    plant_claim(save, host="node-7", written=time.time() - 20)
    cfg = tiny_config(tiny_dataset, save, tmp_path / "cache", "max_duration=1ba", "samples.enabled=false")
    with pytest.raises(SaveFolderInUseError) as refused:
        fit(cfg)
    text = str(refused.value)
    assert "another run (run-a) is training into save_folder" in text and "host node-7 (pid 4000000)" in text
    assert "give this run its own save_folder=" in text and str(save / OWNER_FILENAME) in text
    assert not list(save.glob("*.pt")), "it read or wrote checkpoints before refusing"
    plant_claim(save, host="node-7", written=time.time() - OWNER_TTL_S - 5)
    with single_threaded_torch():
        fit(cfg)
    assert read_claim(str(save)) is None, "the run's own claim outlived it"


def test_a_second_run_into_a_live_runs_save_folder_is_refused(tiny_dataset: str, tmp_path: Path) -> None:
    """The same command twice, the second with its own data.cache_dir (what the cache lock's refusal used to
    advise): it resumed beside the live run, and the two overwrote each other's checkpoints."""
    save = tmp_path / "save"

    def train_argv(cache: str) -> list[str]:
        overrides = tiny_overrides(
            tiny_dataset, save, tmp_path / cache, "max_duration=2000ba", "save_interval=2ba"
        )
        return [PYTHON, "-m", "train", "fit", "tiny", *overrides, "samples.enabled=false"]

    first = subprocess.Popen(train_argv("c1"), cwd=REPO_ROOT, env=job_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not list(save.glob("ep*-ba2-rank0.pt")):
            assert first.poll() is None and time.time() < deadline, "the first run never saved"
            time.sleep(0.2)
        second = subprocess.run(
            train_argv("c2"), cwd=REPO_ROOT, env=job_env(), capture_output=True, text=True, timeout=120
        )
        assert second.returncode == control.EXIT_FATAL, second.stderr[-3000:]
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert (
            lines[-1].startswith("error: another run (") and f"pid {first.pid} on this host" in lines[-1]
        ), lines
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)  # saves and stops (75), releasing its claim at close
        assert first.wait(timeout=120) == control.EXIT_RESUMABLE
    assert read_claim(str(save)) is None


def test_a_run_whose_folder_was_taken_over_stops_without_saving(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that stalled past OWNER_TTL_S and was taken over by a rerun elsewhere used to overwrite the
    taker's claim at its next renewal, and both trained into the folder. Now its renewal finds the taker's
    claim, leaves it, and the run stops at the next step boundary (before anything is saved)."""
    from train.loop.trainer import fit

    monkeypatch.setattr(owner_module, "OWNER_REFRESH_S", 0.0)  # a renewal at every step
    save = tmp_path / "save"
    cfg = tiny_config(
        tiny_dataset, save, tmp_path / "cache", "max_duration=2000ba", "save_interval=1000ba",
        "samples.enabled=false",
    )  # fmt: skip
    took: list[Claim] = []

    def take_over_once_renewed() -> None:
        deadline = time.monotonic() + 120
        first = None
        while time.monotonic() < deadline:
            claim = read_claim(str(save))
            if claim is not None and first is None:
                first = claim.written
            elif claim is not None and claim.written != first:  # renewed: the run is stepping
                took.append(take_over(save))
                return
            time.sleep(0.05)

    thief = threading.Thread(target=take_over_once_renewed, daemon=True)
    thief.start()
    with single_threaded_torch(), pytest.raises(SaveFolderTakenError) as stopped:
        fit(cfg)
    thief.join(5)
    assert took, "the run never renewed its claim"
    text = str(stopped.value)
    assert f"run-b (host node-7, pid 4000000) took over save_folder {save}" in text, text
    assert "stopped without saving" in text and "give this run its own save_folder=" in text
    assert read_claim(str(save)) == took[0], "the taker's claim was overwritten or released"
    assert not list(save.glob("*.pt")) and not list(save.glob("**/*.pt")), "it saved after the loss"


# (interval, duration, the step after which the folder is taken over, the one save written before it):
# an interval in batches is checked at BATCH_END, one in epochs (8 batches of tiny_dataset) at EPOCH_END.
SAVE_AFTER_TAKEOVER = {
    "batches": ("5ba", "12ba", 7, "ep0-ba5-rank0.pt"),
    "epochs": ("1ep", "3ep", 10, "ep1-ba8-rank0.pt"),
}


@pytest.mark.parametrize("unit", list(SAVE_AFTER_TAKEOVER))
def test_a_save_due_right_after_a_takeover_is_not_written(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unit: str
) -> None:
    """Renewals come every OWNER_REFRESH_S: a run taken over between two of them (back from a stall) wrote
    its next save, and `latest`, into the taker's folder before its renewal stopped it. Rank 0 now reads
    the claim at the boundary of every step that saves: the save due right after the takeover is not
    written."""
    from train.loop.trainer import fit

    interval, duration, taken_after, kept = SAVE_AFTER_TAKEOVER[unit]
    monkeypatch.setattr(owner_module, "OWNER_REFRESH_S", 3600.0)  # no renewal in this run: the save finds it
    save = tmp_path / "save"
    cfg = tiny_config(
        tiny_dataset, save, tmp_path / "cache", f"max_duration={duration}", f"save_interval={interval}",
        "samples.enabled=false",
    )  # fmt: skip
    took: list[Claim] = []
    renew_at_step = owner_module.SaveFolderOwner.batch_end

    def taken_over_mid_interval(self: owner_module.SaveFolderOwner, state: Any, logger: Any) -> None:
        if int(state.timestamp.batch) == taken_after:
            took.append(take_over(save))
        renew_at_step(self, state, logger)

    monkeypatch.setattr(owner_module.SaveFolderOwner, "batch_end", taken_over_mid_interval)
    with single_threaded_torch(), pytest.raises(SaveFolderTakenError) as stopped:
        fit(cfg)
    assert f"run-b (host node-7, pid 4000000) took over save_folder {save}" in str(stopped.value)
    saved = sorted(path.name for path in save.glob("**/*.pt") if not path.is_symlink())
    assert saved == [kept], f"saved into the taker's folder after the takeover: {saved}"
    assert (save / LATEST_NAME).resolve().name == kept
    assert read_claim(str(save)) == took[0], "the taker's claim was overwritten or released"


def test_every_rank_stops_before_the_first_save_after_a_takeover(tiny_dataset: str, tmp_path: Path) -> None:
    """Two ranks under torchrun (FSDP, sharded saves): rank 0 alone reads the claim, the second all-reduce
    carries its answer to every rank at the same step, so both stop before the save (none hangs in a save's
    collective the other never joins). The claim is taken over as soon as the first save is there; the next
    is 10 steps later, the margin a loaded box needs to write it first."""
    save = tmp_path / "save"
    overrides = tiny_overrides(
        tiny_dataset, save, tmp_path / "cache", "max_duration=2000ba", "save_interval=10ba",
        "fsdp=true", "device=cpu",
    )  # fmt: skip
    argv = [
        *TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=2",
        "-m", "train", "fit", "tiny", *overrides, "samples.enabled=false",
    ]  # fmt: skip
    env = {**job_env(), "NODE_RANK": "0"}
    run = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)  # fmt: skip
    try:
        deadline = time.time() + 240
        while read_claim(str(save)) is None or not (save / LATEST_NAME).exists():
            assert run.poll() is None and time.time() < deadline, "the run never saved"
            time.sleep(0.02)
        taker = take_over(save)
        _, stderr = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    # torchrun's own code for ranks that failed; each rank exited 2 and recorded it for the supervisor
    assert run.returncode == TORCHRUN_FAILED, stderr[-3000:]
    assert "error: run-b (host node-7, pid 4000000) took over save_folder" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    saves = {path.name.split("-rank")[0] for path in save.glob("**/ep*-ba*") if not path.is_symlink()}
    assert saves == {"ep1-ba10"}, f"saved into the taker's folder after the takeover: {sorted(saves)}"
    assert read_claim(str(save)) == taker


def test_a_claim_that_cannot_be_read_in_time_lets_the_save_go_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`confirm` before a save: an outage (a failed or slow read) never stops a run; only another run's
    claim does. No claim (removed by hand) is still this run's folder."""
    owner = claim_save_folder(str(tmp_path), "run-a", settle_s=0)
    assert owner.confirm(wait_s=5)
    with monkeypatch.context() as patch:
        patch.setattr(owner_module.claims, "read_claim", lambda uri: time.sleep(3))
        started = time.monotonic()
        assert owner.confirm(wait_s=0.2) and time.monotonic() - started < 2, "a slow read held the save"

    def refused(uri: str) -> None:
        raise OSError("connection refused")

    with monkeypatch.context() as patch:
        patch.setattr(owner_module.claims, "read_claim", refused)
        assert owner.confirm(wait_s=5)
    (tmp_path / OWNER_FILENAME).unlink()
    assert owner.confirm(wait_s=5) and owner.lost is None
    taker = take_over(tmp_path)
    assert not owner.confirm(wait_s=5) and owner.lost == taker
    assert not owner.confirm(wait_s=5), "a lost folder came back"
    owner.post_close()
    assert read_claim(str(tmp_path)) == taker, "the close released the taker's claim"


@pytest.mark.s3
def test_an_s3_save_folder_is_claimed_and_released(s3_prefix: str) -> None:
    save = f"{s3_prefix}/run"
    owner = claim_save_folder(save, "run-s3", settle_s=0)
    claim = read_claim(save)
    assert claim is not None and claim.same_owner(this_claim("run-s3"))
    owner.post_close()
    assert not storage.exists(f"{save}/{OWNER_FILENAME}")
