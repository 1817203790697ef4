"""The newcomer's first hour (issue 26): `make demo`, then each command they type next, in a fresh folder.

Each command is the one the Makefile runs (read with `make -n`, see tests/train/conftest.py), run where a
newcomer runs it, so its relative `outputs/` are the demo's. Every one either does something useful on the
demo's outputs or exits with a short message naming the command that would; none prints a traceback.
The demo itself is the session's shared `make demo` run (tests/train/loop/test_learning.py checks what it
learned); `make bench`, which reads nothing of the demo's, is the session's shared run in a folder of its
own (tests/train/conftest.py bench_alone, checked in tests/train/bench/test_bench_scale_counters.py).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.train.conftest import DemoRun, run_make


def ran(result: subprocess.CompletedProcess, code: int = 0) -> str:
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    assert result.returncode == code, result.stdout[-3000:]
    return result.stdout


@pytest.mark.slow
def test_every_next_command_after_the_demo_works_or_says_what_to_do(demo_run: DemoRun) -> None:
    cwd, root = demo_run.cwd, demo_run.root
    assert "Traceback" not in demo_run.output
    assert (root / "samples.png").exists() and (root / "pipeline" / "model_index.json").exists()

    # make train: the demo's run is finished; one short message says how to train longer
    out = ran(run_make(cwd, "train"), code=2)
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    assert "already finished: its latest checkpoint is at 600ba" in lines[at], out[-2000:]
    assert "make train ARGS='max_duration=1200ba'" in lines[at + 1] and not lines[at + 2 :], out[-2000:]
    assert "leaked" not in out  # stopped before any Streaming dataset (and its shared memory) existed

    # make encode: the sample dataset is the demo's, already encoded
    assert "up to date" in ran(run_make(cwd, "encode"))

    # make export: the demo's run -> outputs/pipeline
    assert "exported ema weights" in ran(run_make(cwd, "export"))
    assert (cwd / "outputs" / "pipeline" / "model_index.json").exists()

    # make estimate (make bench: the session's shared run, tests/train/conftest.py bench_alone)
    ran(run_make(cwd, "estimate"))
    assert (cwd / "outputs" / "estimate" / "estimate.json").exists()

    # make train GPUS=2 DRY_RUN=1: this run's numbers, SD2-base's only as a labelled reference
    out = ran(run_make(cwd, "train", "GPUS=2", "DRY_RUN=1"))
    assert "4 GiB memory" in out and "this run: 600ba = 19,200 samples of the tiny preset" in out
    assert all("not this run" in line for line in out.splitlines() if "days" in line)

    # what the finished-run message says to do works: the run goes on from its checkpoint
    out = ran(run_make(cwd, "train", "ARGS=max_duration=602ba"))
    assert "done at 602 batches" in out
    rows = [json.loads(line) for line in (root / "train" / "metrics.jsonl").read_text().splitlines() if line]
    assert max(r["step"] for r in rows if "step" in r) >= 601
