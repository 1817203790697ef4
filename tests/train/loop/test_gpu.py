"""On a GPU (skipped without CUDA, see tests/conftest.py): the production switches together, and no host
sync inside the step (issue 11).

- bf16 + channels_last + compiled U-Net + FSDP (SHARD_GRAD_OP) on one GPU: 10 steps, a resume to 20, an
  export that StableDiffusionPipeline loads; the U-Net counts as compiled through Composer's FSDP wrapper,
  and cuDNN autotuning is on;
- the step (objective, U-Net forward and backward, optimizer) under `torch.cuda.set_sync_debug_mode`, with
  its warnings turned into errors: not one sync;
- the real trainer on the GPU: read-backs only at log and checkpoint steps, as on CPU;
- compile_mode=reduce-overhead (CUDA graphs): the step's losses are the default-mode compiled step's, no
  graph is left uncaptured, and Composer's loop (clipping, EMA, checkpoints, sample grids) trains and
  resumes on it.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from shared.presets import get_preset
from shared.runtime.device import resolve_device_setup
from tests.train.conftest import tiny_config
from tests.train.loop.test_step_syncs import LOG_EVERY, SAVE_AT, STEPS, run_counted
from train.bench.step import StepBench, synthetic_latent_batch, train_step
from train.export.pipeline import export_pipeline
from train.loop.trainer import fit
from train.model.assemble import forget_compiled_code
from train.model.kernels import is_compiled, max_graphs_under_fsdp, unwrapped

pytestmark = pytest.mark.gpu

PRODUCTION = (
    "device=gpu",
    "precision=amp_bf16",
    "channels_last=true",
    "compile=true",
    "samples.enabled=false",
)
# one microbatch per step: a graph's replay reuses the memory the last microbatch's gradients are in
CUDA_GRAPHS = ("compile_mode=reduce-overhead", "device_microbatch_size=8")


def gpu_config(data: str, base: Path, *extra: str) -> Any:
    return tiny_config(data, base / "save", base / "cache", *PRODUCTION, *extra)


def test_bf16_channels_last_compiled_fsdp_trains_resumes_and_exports(
    tiny_dataset: str, tmp_path: Path
) -> None:
    torch._dynamo.reset()
    # every FSDP unit compiled, none left eager by dynamo's recompile limit (train/model/kernels.py)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        first = fit(
            gpu_config(tiny_dataset, tmp_path, "fsdp=true", "max_duration=10ba", "save_interval=10ba")
        )
    model = first.state.model
    # Composer replaced model.unet with its FSDP wrapper, whose own _compiled_call_impl is None (issue 22)
    assert isinstance(model.unet, FullyShardedDataParallel) and is_compiled(model.unet)
    assert model.memory_format == torch.channels_last and first.state.fsdp_enabled
    assert torch.backends.cudnn.benchmark
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 2 * max_graphs_under_fsdp(unwrapped(model.unet)), graphs
    resumed = fit(gpu_config(tiny_dataset, tmp_path, "fsdp=true", "max_duration=20ba", "save_interval=10ba"))
    assert int(resumed.state.timestamp.batch) == 20
    lines = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 21))
    assert all(math.isfinite(line["loss"]) for line in lines)
    out = tmp_path / "pipeline"
    assert export_pipeline(str(tmp_path / "save"), str(out)).weights == "ema"

    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(
        str(out), safety_checker=None, requires_safety_checker=False, local_files_only=True
    )
    assert pipe.unet.config.sample_size == get_preset("tiny").latent_shape(64)[1]


def test_the_step_never_syncs_the_host(tiny_dataset: str, tmp_path: Path) -> None:
    cfg = gpu_config(tiny_dataset, tmp_path)
    setup = resolve_device_setup("gpu", "amp_bf16", channels_last=True)
    bench = StepBench(cfg, setup, online=False)
    batch = synthetic_latent_batch(get_preset("tiny"), 64, 4, setup, 0)
    for _ in range(3):  # compilation, optimizer state, allocator warm-up
        train_step(bench.model, bench.optimizer, batch, setup)
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                train_step(bench.model, bench.optimizer, batch, setup)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_trainer_reads_back_only_at_log_and_checkpoint_steps_on_gpu(
    tiny_dataset: str, tmp_path: Path
) -> None:
    _, counts = run_counted(tiny_dataset, tmp_path, *PRODUCTION)
    flush_steps = {LOG_EVERY, 2 * LOG_EVERY, SAVE_AT, STEPS}
    assert set(counts.steps_with("train/")) <= flush_steps
    for step in sorted(set(range(1, STEPS + 1)) - flush_steps):
        assert counts.at(step) == {}, step


def test_cuda_graph_step_matches_the_compiled_step_and_trains_in_composer(
    tiny_dataset: str, tmp_path: Path
) -> None:
    setup = resolve_device_setup("gpu", "amp_bf16", channels_last=True)
    losses = {}
    for mode in ("default", "reduce-overhead"):
        forget_compiled_code()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        bench = StepBench(
            gpu_config(tiny_dataset, tmp_path / mode, f"compile_mode={mode}"), setup, online=False
        )
        batch = synthetic_latent_batch(get_preset("tiny"), 64, 4, setup, 0)
        # cudagraph trees run the first call eagerly, record the second, replay from the third on
        steps = [train_step(bench.model, bench.optimizer, batch, setup).detach().float() for _ in range(5)]
        losses[mode] = torch.stack(steps).cpu()
        assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0, mode
        del bench
    # the same inductor kernels, launched from a graph; cuDNN may pick other conv algorithms per process
    torch.testing.assert_close(losses["reduce-overhead"], losses["default"], rtol=1e-2, atol=0)

    forget_compiled_code()
    # with sample grids between steps: the EMA swapped in place, the captured U-Net called eagerly in
    # eval mode (train/export/samples.py `uncompiled`), then training replays its graphs again
    grids = ("samples.enabled=true", "samples.interval=3ba", "samples.steps=2")
    first = fit(
        gpu_config(
            tiny_dataset, tmp_path / "fit", *CUDA_GRAPHS, *grids, "max_duration=6ba", "save_interval=3ba"
        )
    )
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert int(first.state.timestamp.batch) == 6
    assert len(list((tmp_path / "fit" / "save" / "samples").glob("ba*.png"))) == 2  # at 3 and 6
    resumed = fit(
        gpu_config(tiny_dataset, tmp_path / "fit", *CUDA_GRAPHS, "max_duration=9ba", "save_interval=3ba")
    )
    assert int(resumed.state.timestamp.batch) == 9
    lines = (tmp_path / "fit" / "save" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 10))
    assert all(math.isfinite(json.loads(line)["loss"]) for line in lines)


def test_the_sd2_recipe_on_one_gpu_is_unwrapped_with_the_microbatch_that_fits_it(tmp_path: Path) -> None:
    """fsdp: null and device_microbatch_size=null decided for this GPU as a run decides them (no training:
    the shapes are SD2-base's): no FSDP on one rank, the largest microbatch dividing 2048 that fits here."""
    from shared.config import load_config
    from shared.estimate.memory import microbatch_that_fits
    from train.config import TrainConfig
    from train.loop.prepare import gpu_memory, resolve_fsdp, resolve_microbatch

    null = [f"save_folder={tmp_path}", "device_microbatch_size=null"]
    cfg = resolve_microbatch(resolve_fsdp(load_config(TrainConfig, "sd2-base-256", null), 1), "gpu", 1)
    _, memory_gb = gpu_memory()
    expected = microbatch_that_fits(memory_gb, "sd2-base", 256, 2048, 1, "DDP")
    assert cfg.fsdp is False and cfg.device_microbatch_size == expected and expected >= 64  # 80 GB and up
