"""The held-out loss of a 2-rank run (CPU gloo ranks under torchrun, the way the local launcher starts
them) equals `train eval` of its checkpoints on one process: sharding the samples over ranks changes
nothing but float rounding."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.train.conftest import REPO_ROOT, TORCHRUN, tiny_overrides
from train.eval.checkpoint import evaluate_checkpoint

RUN_TIMEOUT_S = 300
# 5 samples over 2 ranks: rank 1 has fewer pairs and pads with weight-0 pairs to run rank 0's forwards.
EVAL = ["eval.interval=2ba", "eval.num_samples=5", "eval.timesteps=[50,500,950]", "eval.batch_size=4"]


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_log_what_one_process_computes(
    tiny_dataset: str, tiny_dataset_b: str, tmp_path: Path
) -> None:
    save = tmp_path / "save"
    overrides = tiny_overrides(tiny_dataset, save, tmp_path / "cache", "max_duration=4ba")
    argv = [
        *TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=2",
        "-m", "train", "fit", "tiny", *overrides, "samples.enabled=false", "save_interval=2ba",
        "ema.smoothing=0.9", f"eval.uri={tiny_dataset_b}", *EVAL,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NODE_RANK": "0"}
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-4000:]
    assert (done.stdout + done.stderr).count("eval at batch 4: ema loss") == 1  # rank 0's line, once
    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    logged = {line["step"]: line for line in lines if "eval/ema/loss" in line}
    assert sorted(logged) == [2, 4]
    for step, name in ((2, "ep0-ba2-rank0.pt"), (4, "ep0-ba4-rank0.pt")):
        for weights in ("ema", "training"):
            result = evaluate_checkpoint(str(save / name), weights, cache_dir=str(tmp_path / "cache"))
            for key, value in result.metrics.items():
                assert value == pytest.approx(logged[step][key], rel=1e-5), (step, key)
