"""Bucketed data resumes exactly past the first epoch: after a SIGKILL on 1 rank and across 2 -> 1 ranks, the
same bucket of every step, the same losses and the same weights as the uninterrupted run (Streaming's
per_stream batching resumes at a global batch boundary, which every checkpoint is).

`tiny_bucketed_dataset` (80x48: 16, 64x64: 24, 48x80: 16 rows) is 7 global batches of 8 an epoch;
checkpoints every 9 batches: the batch-9 one is 2 batches into epoch 1; runs end at batch 14.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.train.checkpoints.test_resume_mix import RUN_TIMEOUT_S, train_ranks
from tests.train.checkpoints.test_resume_ranks import (
    LOSS_ATOL,
    LOSS_RTOL,
    WEIGHT_ATOL,
    assert_same_weights,
    final_state,
)
from tests.train.conftest import TINY_BUCKETS, run_train_cli, tiny_overrides
from train.data.stream_counts import BUCKET_PREFIX

NAMES = list(TINY_BUCKETS)
SETTINGS = ["samples.enabled=false", "save_interval=9ba", "ema.smoothing=0.9", "log.console_interval=1ba"]


def overrides(data: str, save: Path, max_batches: int) -> list[str]:
    cache = save.parent / f"cache-{save.name}"
    return [*tiny_overrides(data, save, cache, f"max_duration={max_batches}ba"), *SETTINGS]


def rows(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def counts(save: Path) -> dict[int, list[int]]:
    return {r["step"]: [r.get(BUCKET_PREFIX + n, 0) for n in NAMES] for r in rows(save)}


def buckets_per_step(save: Path) -> list[str]:
    """The one bucket each step trained on (from the cumulative counts logged every step)."""
    out, before = [], [0] * len(NAMES)
    for step, now in sorted(counts(save).items()):
        grew = [NAMES[i] for i, (a, b) in enumerate(zip(before, now, strict=True)) if b != a]
        deltas = [b - a for a, b in zip(before, now, strict=True) if b != a]
        assert len(grew) == 1 and deltas == [8], f"step {step} mixed buckets: {before} -> {now}"
        out.append(grew[0])
        before = now
    return out


@pytest.fixture(scope="module")
def baseline(tiny_bucketed_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 1-rank run to batch 14."""
    base = tmp_path_factory.mktemp("resume-buckets")
    train_ranks(1, overrides(tiny_bucketed_dataset, base / "save", 14), base / "uninterrupted.log")
    return base / "save"


def assert_matches(baseline: Path, resumed: Path, exact: bool) -> None:
    want = buckets_per_step(baseline)
    assert counts(baseline)[7] == list(TINY_BUCKETS.values())  # an epoch takes every bucket whole
    assert counts(baseline)[14] == [2 * n for n in TINY_BUCKETS.values()]
    assert buckets_per_step(resumed) == want
    losses, want_losses = [r["loss"] for r in rows(resumed)], [r["loss"] for r in rows(baseline)]
    if exact:
        assert losses == want_losses
        assert_same_weights(final_state(resumed), final_state(baseline), 0.0)
    else:
        np.testing.assert_allclose(
            losses, [r["loss"] for r in rows(baseline)], rtol=LOSS_RTOL, atol=LOSS_ATOL
        )
        assert_same_weights(final_state(resumed), final_state(baseline), WEIGHT_ATOL)


@pytest.mark.slow
def test_bucketed_run_killed_past_the_first_epoch_resumes_exactly(
    baseline: Path, tiny_bucketed_dataset: str, tmp_path: Path, killed_temp: Path
) -> None:
    save, log = tmp_path / "save", tmp_path / "run.log"
    args = ["fit", "tiny", *overrides(tiny_bucketed_dataset, save, 14)]
    with log.open("a") as handle:
        proc = run_train_cli(args, killed_temp, stdout=handle, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (save / "latest-rank0.pt").exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert os.path.realpath(save / "latest-rank0.pt").endswith("ep1-ba9-rank0.pt")
    with log.open("a") as handle:
        resumed = run_train_cli(args, stdout=handle, stderr=subprocess.STDOUT)
        assert resumed.wait(timeout=RUN_TIMEOUT_S) == 0, log.read_text()[-3000:]
    assert "autoresume: continuing from" in log.read_text()
    assert_matches(baseline, save, exact=True)


@pytest.mark.dist
@pytest.mark.slow
def test_bucketed_run_on_two_ranks_resumed_on_one_rank(
    baseline: Path, tiny_bucketed_dataset: str, tmp_path: Path
) -> None:
    save, log = tmp_path / "save", tmp_path / "run.log"
    train_ranks(2, overrides(tiny_bucketed_dataset, save, 9), log)
    train_ranks(1, overrides(tiny_bucketed_dataset, save, 14), log)
    assert "autoresume: continuing from" in log.read_text()
    assert_matches(baseline, save, exact=False)
