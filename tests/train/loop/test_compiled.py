"""How a compiled U-Net is split into graphs (train/loop/compiled.py): under DDP (no FSDP, several ranks)
dynamo splits it at every gradient bucket, and `ddp_bucket_cap_mb` is the size Composer's DDP wrap uses.
The 2-rank run is the real `train fit` under torchrun (gloo), compiled with aot_eager."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import ConfigError, load_config
from shared.estimate.cluster import PRESET_PARAMS
from tests.train.conftest import REPO_ROOT, tiny_overrides, write_fake_dataset
from train.config import TrainConfig
from train.model.compile_plan import MB, compile_plan_line, ddp_graphs

SLIM_SD2_BYTES = 32.52 * MB  # SD2-base's module tree at a tenth of its widths, fp32 (preset sd2-base-slim)


def test_ddp_graphs_follow_the_bucket_size_as_counted_on_two_ranks() -> None:
    # counted on 2 gloo ranks, the slim SD2 tree under DDP, compiled (module doc of train/loop/compiled.py)
    assert ddp_graphs(SLIM_SD2_BYTES, 25) == 3
    assert ddp_graphs(SLIM_SD2_BYTES, 4) == 9
    assert ddp_graphs(PRESET_PARAMS["sd2-base"] * 4, 25) == 134


def test_the_dry_run_plan_says_how_many_graphs_ddp_splits_the_unet_into(tmp_path: Path) -> None:
    def line(*extra: str, world: int = 256) -> str:
        cfg = load_config(TrainConfig, "sd2-base-256", [f"save_folder={tmp_path}", *extra], kind="train")
        return compile_plan_line(cfg, "gpu", world, PRESET_PARAMS["sd2-base"] * 4)

    assert "about 134 graphs for its 3,303 MB of fp32 gradients" in line("fsdp=false")
    assert "each 400 MB gradient bucket (ddp_bucket_cap_mb): about 10 graphs" in line(
        "fsdp=false", "ddp_bucket_cap_mb=400"
    )
    assert "whole U-Net as one graph" in line("fsdp=false", world=1)  # one rank: no DDP
    with pytest.raises(ConfigError, match="ddp_bucket_cap_mb"):
        line("fsdp=false", "ddp_bucket_cap_mb=0.5")  # DDP's first bucket is 1 MB: dynamo refuses smaller
    assert "per FSDP unit" in line()


@pytest.mark.slow
@pytest.mark.dist
def test_ddp_splits_the_compiled_unet_at_the_bucket_size_the_run_asks_for(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    write_fake_dataset(data, n=32)
    overrides = tiny_overrides(data, tmp_path / "save", tmp_path / "cache", "max_duration=2ba")
    overrides += [
        "samples.enabled=false",
        "device=cpu",
        "fsdp=false",
        "compile=true",
        "compile_backend=aot_eager",
    ]
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
        "-m", "train", "fit", "tiny", *overrides, "ddp_bucket_cap_mb=1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NODE_RANK": "0"}
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=420)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "DDP: gradients all-reduced in buckets of 1.0 MB (ddp_bucket_cap_mb)" in log
    counts = {int(n) for n in re.findall(r"compile: the first batch compiled (\d+) graphs", log)}
    # the tiny U-Net's 3.0 MB of fp32 gradients: 2 graphs at torch's 25 MB, one per 1 MB bucket here (a
    # bucket takes whole parameters, so the plan's count is "about": 3 counted, 4 planned)
    (graphs,) = counts
    gradient_bytes = PRESET_PARAMS["tiny"] * 4
    assert graphs > ddp_graphs(gradient_bytes, 25) == 2
    assert abs(graphs - ddp_graphs(gradient_bytes, 1)) <= 1
