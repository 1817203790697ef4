"""How a compiled U-Net is split into graphs (train/loop/compiled.py): under DDP (no FSDP, several ranks)
dynamo splits it at every gradient bucket, and `ddp_bucket_cap_mb` is the size Composer's DDP wrap uses.
The 2-rank run is the real `train fit` under torchrun (gloo), compiled with aot_eager."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from shared.config import ConfigError, load_config
from shared.estimate.cluster import PRESET_PARAMS
from tests.train.conftest import REPO_ROOT, TORCHRUN, tiny_overrides, write_fake_dataset
from train.config import TrainConfig
from train.model.compile_plan import MB, compile_plan_line, ddp_graphs

LAYERS = 12  # linear layers of the 2-rank DDP test: 24 parameter tensors, one bucket
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
        *TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=2",
        "-m", "train", "fit", "tiny", *overrides, "ddp_bucket_cap_mb=1", "ddp_reduce_dtype=bf16",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NODE_RANK": "0"}
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=420)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "DDP: gradients all-reduced in buckets of 1.0 MB (ddp_bucket_cap_mb)" in log
    assert "DDP: gradients all-reduced in bf16 (ddp_reduce_dtype)" in log  # the hook under dynamo's split
    counts = {int(n) for n in re.findall(r"compile: the first batch compiled (\d+) graphs", log)}
    # the tiny U-Net's 3.0 MB of fp32 gradients: 2 graphs at torch's 25 MB, one per 1 MB bucket here (a
    # bucket takes whole parameters, so the plan's count is "about": 3 counted, 4 planned)
    (graphs,) = counts
    gradient_bytes = PRESET_PARAMS["tiny"] * 4
    assert graphs > ddp_graphs(gradient_bytes, 25) == 2
    assert abs(graphs - ddp_graphs(gradient_bytes, 1)) <= 1


def backward_ops(model: Any, x: Any) -> int:
    """Top-level ATen ops of one forward and backward (DDP's reducer included: it runs inside autograd's
    hooks)."""
    from tests.train.loop.test_clipping import top_level_aten_ops

    model.zero_grad(set_to_none=True)
    return top_level_aten_ops(lambda: model(x).square().sum().backward())


def ddp_rank(rank: int, store: str, reduce_dtype: str, out: Any) -> None:
    """One gloo rank: Composer's own DDP wrap, as the train job patches it, then one backward whose inputs
    differ by rank; what the all-reduce left in the gradients, where they live, what passed through
    torch.distributed, and the ATen ops DDP added to a later backward."""
    import torch
    import torch.distributed as torch_dist
    from composer.trainer import trainer as composer_trainer

    from train.loop.comm_counter import count_collectives
    from train.loop.compiled import composer_ddp

    # a spawned rank inherits its pytest worker's environment, where an in-process Composer run may have
    # left WORLD_SIZE=1; Composer checks these against torch.distributed
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", NODE_RANK="0"
    )
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(LAYERS)])
        local = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(LAYERS)])
        local.load_state_dict(net.state_dict())
        with composer_ddp(25.0, reduce_dtype):
            ddp = composer_trainer.prepare_ddp_module(net, False)
        inputs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        with count_collectives() as count:
            ddp(inputs[rank]).square().sum().backward()
        for x in inputs:  # the mean of both ranks' gradients, unreduced
            (local(x).square().sum() / 2).backward()
        error = max(
            float((p.grad - q.grad).abs().max() / q.grad.abs().max())
            for p, q in zip(net.parameters(), local.parameters(), strict=True)
        )
        params = sum(p.numel() for p in net.parameters())
        backward_ops(ddp, inputs[rank])  # DDP rebuilds its buckets in the order of the first backward
        added = backward_ops(ddp, inputs[rank]) - backward_ops(local, inputs[rank])
        # the gradients are views into DDP's bucket (one bucket here), also once zero_grad set them to None
        storages = {p.grad.untyped_storage().data_ptr() for p in net.parameters()}
        assert ddp.gradient_as_bucket_view and len(storages) == 1, storages
        out.put((rank, count.calls.get("all_reduce", 0), count.bytes / params, error, added))
    except BaseException:
        torch_dist.destroy_process_group()
        raise
    torch_dist.barrier()
    # done with the group: leave without gloo's teardown, which can hang a rank (test_launch_memory.py)
    os._exit(0)


@pytest.mark.timeout(120)
def test_ddp_reduce_dtype_bf16_all_reduces_half_the_bytes_into_the_same_gradients(
    tmp_path: Path, killed_temp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ddp_reduce_dtype=bf16: Composer's DDP wrap gets torch's bf16_compress_hook, whose all-reduce passes
    through torch.distributed with 2 bytes a parameter (fp32's reducer all-reduces in C++, unseen by the
    counter), and leaves the mean gradient to bf16's precision; fp32 leaves it to float rounding."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("TMPDIR", str(killed_temp))  # the ranks leave by os._exit: their temp folder
    results = {}
    for dtype in ("fp32", "bf16"):
        out = mp.get_context("spawn").SimpleQueue()
        mp.spawn(ddp_rank, args=(str(tmp_path / f"store-{dtype}"), dtype, out), nprocs=2, join=True)
        results[dtype] = sorted(out.get() for _ in range(2))
    tensors = 2 * LAYERS
    for rank, calls, bytes_per_param, error, added in results["fp32"]:
        assert (calls, bytes_per_param) == (0, 0.0) and error < 1e-6, (rank, error)
        # per gradient: its bucket view and its 1/world scaling, no copy into the bucket (3 with copies)
        assert added <= 2 * tensors + 4, (rank, added)
    for rank, calls, bytes_per_param, error, added in results["bf16"]:
        assert (calls, bytes_per_param) == (1, 2.0) and 1e-6 < error < 1e-2, (rank, error)
        assert added <= 2 * tensors + 8, (rank, added)  # the hook scales the bucket once, then copies back


def test_ddp_reduce_dtype_takes_fp32_or_bf16_and_the_plan_prices_it(tmp_path: Path) -> None:
    from shared.launch.plan import LaunchOptions
    from shared.launch.report import summarize
    from train.launch import plan_train

    with pytest.raises(ConfigError, match="ddp_reduce_dtype"):
        load_config(TrainConfig, "sd2-base-256", ["ddp_reduce_dtype=fp16"], kind="train")
    save = [f"save_folder={tmp_path}", "data.uri=s3://b/d", "fsdp=false"]
    for dtype, line in [("fp32", "6.900 GB"), ("bf16", "3.450 GB")]:
        plan = plan_train("sd2-base-256", [*save, f"ddp_reduce_dtype={dtype}"], LaunchOptions(256, "slurm"))
        assert f"(DDP, 1 microbatch): 1 all-reduce of {dtype} grads {line}" in summarize(plan)
