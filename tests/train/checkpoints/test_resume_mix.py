"""A data.streams mix resumes exactly past the first epoch, with `choose` (a subsample drawn anew each epoch)
and `repeat` (an upsample), after a SIGTERM stop and a SIGKILL on 1 rank and across 1 <-> 2 ranks: the
same samples per stream, the same losses and the same weights as the uninterrupted run (Streaming's issue
#869 reports resumes past the first epoch going wrong with choose/repeat; its resume state is only (epoch,
samples into it)).

The mix: `tiny_dataset` (64 rows) with choose 8 and `tiny_dataset_b` (32 rows) with repeat 1.25 (8 of its
rows twice) = 48, so one epoch is 48 samples = 6 global batches of 8. Checkpoints every 8 batches: the
batch-8 one is 2 batches into epoch 1; runs end at batch 16, 4 batches into epoch 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.train.checkpoints.test_resume_ranks import (
    LOSS_ATOL,
    LOSS_RTOL,
    WEIGHT_ATOL,
    assert_same_weights,
    final_state,
    seed_save_folder,
)
from tests.train.conftest import REPO_ROOT, TORCHRUN, run_train_cli, stream_overrides, tiny_overrides
from train.data.stream_counts import METRIC_PREFIX

RUN_TIMEOUT_S = 300
NAMES = ["laion", "coyo"]
SETTINGS = ["samples.enabled=false", "save_interval=8ba", "ema.smoothing=0.9", "log.console_interval=2ba"]
EPOCH_COUNTS = [8, 40]  # choose 8 of 64; repeat 1.25 x 32


def overrides(a: str, b: str, save: Path, max_batches: int) -> list[str]:
    mix = stream_overrides(f"{{uri: {a}, name: laion, choose: 8}}", f"{{uri: {b}, name: coyo, repeat: 1.25}}")
    cache = save.parent / f"cache-{save.name}"
    return [*tiny_overrides("", save, cache, f"max_duration={max_batches}ba"), *mix, *SETTINGS]


def train_ranks(ranks: int, args: list[str], log: Path) -> None:
    argv = [
        *TORCHRUN, "--standalone", "--nnodes=1",
        f"--nproc-per-node={ranks}", "-m", "train", "fit", "tiny", *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NODE_RANK": "0"}
    with log.open("a") as handle:
        done = subprocess.run(
            argv, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
        )
    assert done.returncode == 0, log.read_text()[-4000:]


def rows(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def counts(save: Path) -> dict[int, list[int]]:
    return {
        r["step"]: [r[METRIC_PREFIX + n] for n in NAMES] for r in rows(save) if METRIC_PREFIX + "laion" in r
    }


def losses(save: Path) -> list[float]:
    return [r["loss"] for r in rows(save)]


class Baseline:
    def __init__(self, a: str, b: str, save: Path):
        self.a, self.b, self.save = a, b, save


@pytest.fixture(scope="module")
def baseline(tiny_dataset: str, tiny_dataset_b: str, tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    """The uninterrupted 1-rank run to batch 16."""
    base = tmp_path_factory.mktemp("resume-mix")
    run = Baseline(tiny_dataset, tiny_dataset_b, base / "uninterrupted")
    train_ranks(1, overrides(run.a, run.b, run.save, 16), base / "uninterrupted.log")
    return run


def assert_matches(baseline: Baseline, resumed: Path, weight_atol: float, exact: bool = False) -> None:
    want = counts(baseline.save)
    # Streaming's semantics: every epoch gives each stream exactly its choose / repeat share.
    assert want[6] == EPOCH_COUNTS and want[12] == [2 * c for c in EPOCH_COUNTS]
    assert sorted(want) == list(range(2, 17, 2)) and all(sum(want[s]) == 8 * s for s in want)
    assert counts(resumed) == want
    assert [r["step"] for r in rows(resumed)] == list(range(1, 17))
    if exact:
        assert losses(resumed) == losses(baseline.save)
    else:
        np.testing.assert_allclose(losses(resumed), losses(baseline.save), rtol=LOSS_RTOL, atol=LOSS_ATOL)
    assert_same_weights(final_state(resumed), final_state(baseline.save), weight_atol)


@pytest.mark.slow
def test_mix_stopped_between_saves_then_killed_past_the_first_epoch_resumes_exactly(
    baseline: Baseline, tmp_path: Path, killed_temp: Path
) -> None:
    """A SIGTERM saves the step it lands on (not an interval one: the per-stream counts must be that step's,
    they were the last interval's), exit 75; the rerun is killed after its batch-8 checkpoint; the third
    attempt ends on the uninterrupted run's counts, losses and weights."""
    save, log = tmp_path / "save", tmp_path / "run.log"
    args = ["fit", "tiny", *overrides(baseline.a, baseline.b, save, 16)]
    with log.open("a") as handle:
        proc = run_train_cli(args, stdout=handle, stderr=subprocess.STDOUT)
    wait_until(lambda: (save / "metrics.jsonl").exists() and rows(save), proc, log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=RUN_TIMEOUT_S) == 75, log.read_text()[-3000:]
    stopped = os.path.realpath(save / "latest-rank0.pt")
    assert not stopped.endswith(("ba8-rank0.pt", "ba16-rank0.pt")), stopped  # between interval saves
    with log.open("a") as handle:
        proc = run_train_cli(args, killed_temp, stdout=handle, stderr=subprocess.STDOUT)
    wait_until(lambda: os.path.realpath(save / "latest-rank0.pt").endswith("ep1-ba8-rank0.pt"), proc, log)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    with log.open("a") as handle:
        resumed = run_train_cli(args, stdout=handle, stderr=subprocess.STDOUT)
        assert resumed.wait(timeout=RUN_TIMEOUT_S) == 0, log.read_text()[-3000:]
    assert log.read_text().count("autoresume: continuing from") == 2
    assert_matches(baseline, save, weight_atol=0.0, exact=True)


def wait_until(ready: Callable[[], Any], proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not ready():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)


@pytest.mark.dist
@pytest.mark.slow
def test_mix_on_two_ranks_resumed_on_one_rank_past_the_first_epoch(
    baseline: Baseline, tmp_path: Path
) -> None:
    save, log = tmp_path / "save", tmp_path / "run.log"
    train_ranks(2, overrides(baseline.a, baseline.b, save, 8), log)
    train_ranks(1, overrides(baseline.a, baseline.b, save, 16), log)
    assert "autoresume: continuing from" in log.read_text()
    assert_matches(baseline, save, WEIGHT_ATOL)


@pytest.mark.dist
@pytest.mark.slow
def test_mix_on_one_rank_resumed_on_two_ranks_past_the_first_epoch(
    baseline: Baseline, tmp_path: Path
) -> None:
    save, log = tmp_path / "save", tmp_path / "run.log"
    (checkpoint,) = baseline.save.glob("ep1-ba8-rank0.pt")
    seed_save_folder(checkpoint, save)
    # metrics.jsonl as the 1-rank run had written it by its batch-8 checkpoint
    (save / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(baseline.save)[:8]))
    train_ranks(2, overrides(baseline.a, baseline.b, save, 16), log)
    assert "autoresume: continuing from" in log.read_text()
    assert_matches(baseline, save, WEIGHT_ATOL)
