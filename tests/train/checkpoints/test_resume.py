"""Crash safety: `python -m train fit` killed with SIGKILL after a checkpoint, rerun with the same command,
ends bitwise identical to a run that was never interrupted (mid-epoch resume, across an epoch boundary)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.train.conftest import run_train_cli, tiny_overrides, write_fake_dataset
from train.checkpoints.files import read_checkpoint
from train.ema.algorithm import select_unet_weights

# 24 rows / 4 per batch = 6 batches per epoch: the ba4 checkpoint is mid-epoch and the run crosses epochs.
SETTINGS = [
    "max_duration=16ba", "save_interval=4ba", "samples.enabled=false",
    "global_batch_size=4", "device_microbatch_size=2",
]  # fmt: skip
START_TIMEOUT_S = 300


# issue 30's speed switches: low-precision norms and the U-Net compiled (aot_eager: inductor's graphs, ATen's
# kernels; a CPU run would otherwise spend minutes compiling C++)
SPEED_SWITCHES = ("model.low_precision_norms=true", "compile=true", "compile_backend=aot_eager")


def start(
    data: str, save: Path, cache: Path, log: Path, *switches: str, temp: Path | None = None
) -> subprocess.Popen:
    handle = log.open("a")
    args = ["fit", "tiny", *tiny_overrides(data, save, cache, *SETTINGS, *switches)]
    return run_train_cli(args, temp, stdout=handle, stderr=subprocess.STDOUT)


def kill_after_first_checkpoint(proc: subprocess.Popen, save: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (save / "latest-rank0.pt").exists():
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def final_state(save: Path) -> dict:
    return read_checkpoint(save / "latest-rank0.pt")["state"]


@pytest.mark.slow
# eager: with loader workers, as the shipped recipes read (8 a rank); the position a checkpoint records is
# what the trainer took, not what the workers had read ahead
@pytest.mark.parametrize(
    "switches", [("data.num_workers=2",), SPEED_SWITCHES], ids=["eager_loader_workers", "speed_switches"]
)
def test_killed_and_resumed_run_matches_uninterrupted_run(
    tmp_path: Path, switches: tuple[str, ...], killed_temp: Path
) -> None:
    data = str(tmp_path / "data")
    write_fake_dataset(data, n=24)
    full, crash = tmp_path / "full", tmp_path / "crash"
    # Both start together (2 cores); the crashing one is killed as soon as its first checkpoint is published.
    uninterrupted = start(data, full, tmp_path / "cache-full", tmp_path / "full.log", *switches)
    crash_log = tmp_path / "crash.log"
    crashing = start(data, crash, tmp_path / "cache-crash", crash_log, *switches, temp=killed_temp)
    kill_after_first_checkpoint(crashing, crash)
    assert crashing.returncode == -signal.SIGKILL
    resumed_from = os.path.realpath(crash / "latest-rank0.pt")
    resumed = start(data, crash, tmp_path / "cache-crash", tmp_path / "crash.log", *switches)
    assert resumed.wait(timeout=START_TIMEOUT_S) == 0, (tmp_path / "crash.log").read_text()[-3000:]
    assert uninterrupted.wait(timeout=START_TIMEOUT_S) == 0, (tmp_path / "full.log").read_text()[-3000:]

    log = (tmp_path / "crash.log").read_text()
    assert f"autoresume: continuing from {resumed_from}" in log
    assert int(Path(resumed_from).name.split("-ba")[1].split("-")[0]) % 6 != 0, (
        "resume point should be mid-epoch"
    )
    a, b = final_state(full), final_state(crash)
    for save in (full, crash):
        assert (save / "latest-rank0.pt").resolve().name == "ep2-ba16-rank0.pt"
    for which in ("ema", "training"):
        wa, wb = select_unet_weights(a, which)[0], select_unet_weights(b, which)[0]
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"{which} weights differ"
    opt_a, opt_b = a["optimizers"]["AdamW"]["state"], b["optimizers"]["AdamW"]["state"]
    assert all(torch.equal(opt_a[k]["exp_avg"], opt_b[k]["exp_avg"]) for k in opt_a)
    steps = [json.loads(line)["step"] for line in (crash / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 17))
