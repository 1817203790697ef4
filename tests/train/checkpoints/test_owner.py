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

import pytest

from shared import storage
from shared.launch import control
from tests.train.conftest import (
    PYTHON,
    REPO_ROOT,
    job_env,
    single_threaded_torch,
    tiny_config,
    tiny_overrides,
)
from train.checkpoints import owner as owner_module
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
    taker = replace(this_claim("run-b"), host="node-7", pid=4_000_000, launch="")
    took: list[float] = []

    def take_over_once_renewed() -> None:
        deadline = time.monotonic() + 120
        first = None
        while time.monotonic() < deadline:
            claim = read_claim(str(save))
            if claim is not None and first is None:
                first = claim.written
            elif claim is not None and claim.written != first:  # renewed: the run is stepping
                storage.write_json(str(save / OWNER_FILENAME), asdict(taker))
                took.append(time.time())
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
    assert read_claim(str(save)) == taker, "the taker's claim was overwritten or released"
    assert not list(save.glob("*.pt")) and not list(save.glob("**/*.pt")), "it saved after the loss"


@pytest.mark.s3
def test_an_s3_save_folder_is_claimed_and_released(s3_prefix: str) -> None:
    save = f"{s3_prefix}/run"
    owner = claim_save_folder(save, "run-s3", settle_s=0)
    claim = read_claim(save)
    assert claim is not None and claim.same_owner(this_claim("run-s3"))
    owner.post_close()
    assert not storage.exists(f"{save}/{OWNER_FILENAME}")
