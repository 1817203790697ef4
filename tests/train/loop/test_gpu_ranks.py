"""On 2 GPUs (skipped, with the reason, on fewer): the production layout under torchrun, a sharded
checkpoint, and that checkpoint resumed on 1 GPU (issue 22 (6)).

2 ranks: bf16, channels_last, compiled U-Net, FSDP SHARD_GRAD_OP, checkpoint_format=sharded, 2 microbatches
per step (the FSDP no_sync path, train/loop/step.py) for 4 steps; then 1 GPU resumes that save folder to
step 8 (it converts the sharded checkpoint once, train/checkpoints/sharded.py), and the result exports to a
pipeline diffusers loads. Correctness of every consolidation against an uninterrupted run is asserted on
CPU ranks (tests/train/checkpoints/); this checks the same path runs on NCCL and CUDA.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.train.conftest import REPO_ROOT, TORCHRUN, tiny_overrides
from train.checkpoints.files import LATEST_NAME, is_sharded_checkpoint
from train.export.pipeline import export_pipeline

pytestmark = pytest.mark.gpu

RUN_TIMEOUT_S = 600
PRODUCTION = [
    "device=gpu", "precision=amp_bf16", "channels_last=true", "compile=true", "fsdp=true",
    "samples.enabled=false", "save_interval=4ba", "ema.smoothing=0.9",
    "global_batch_size=8", "device_microbatch_size=2",  # 4 a rank on 2 ranks: 2 microbatches a step
]  # fmt: skip


def train(ranks: int, data: str, save: Path, *extra: str) -> None:
    overrides = [*tiny_overrides(data, save, save.parent / f"cache-{ranks}"), *PRODUCTION, *extra]
    launcher = [*TORCHRUN, "--standalone", "--nnodes=1"]
    argv = [*launcher, f"--nproc-per-node={ranks}", "-m", "train", "fit", "tiny", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NODE_RANK": "0"}
    if ranks == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    log = save.parent / f"train-{ranks}.log"
    with log.open("a") as handle:
        done = subprocess.run(
            argv, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
        )
    assert done.returncode == 0, log.read_text()[-4000:]


def test_two_gpu_fsdp_sharded_checkpoint_resumes_on_one_gpu(tiny_dataset: str, tmp_path: Path) -> None:
    visible = torch.cuda.device_count()
    if visible < 2:
        pytest.skip(f"needs 2 GPUs for the torchrun FSDP run, {visible} visible")
    save = tmp_path / "save"
    train(2, tiny_dataset, save, "checkpoint_format=sharded", "max_duration=4ba")
    latest = save / LATEST_NAME
    assert latest.is_symlink() and is_sharded_checkpoint(str(latest.resolve()))
    train(1, tiny_dataset, save, "max_duration=8ba")  # 1 rank: full format, the sharded one converted
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 9))  # steps 5-8 continue the 2-GPU run
    assert all(math.isfinite(row["loss"]) for row in rows)
    out = tmp_path / "pipeline"
    assert export_pipeline(str(save), str(out)).weights == "ema"

    from diffusers import StableDiffusionPipeline

    StableDiffusionPipeline.from_pretrained(
        str(out), safety_checker=None, requires_safety_checker=False, local_files_only=True
    )
