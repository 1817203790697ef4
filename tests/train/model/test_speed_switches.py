"""Issue 30's speed switches keep the step correct on CPU: model.low_precision_norms and compile (aot_eager:
the graphs inductor would compile, run with ATen's kernels).

- the loss equals diffusers' own recipe (DDPMScheduler.add_noise + MSE on the noise, as
  examples/text_to_image/train_text_to_image.py computes it) on the same draws; with low-precision norms
  exactly in fp32 (the swap is the parent's forward there), and within bf16 rounding under autocast;
- the compiled U-Net with the norms swapped, whole or block by block (compile_scope): 0 graph breaks, 0
  recompiles after the first step, the eager step's gradients;
- the step with both switches reads nothing back to the host (the sync-count test's check).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.contract import LATENT_LOGVAR, LATENT_MEAN
from shared.presets import get_preset
from shared.runtime.device import resolve_device_setup
from tests.train.conftest import tiny_config
from train.bench.anatomy.ops import cpu_autocast_like_cuda
from train.bench.step import synthetic_latent_batch, train_step
from train.bench.trainer.syncs import count_readbacks
from train.loop.trainer import build_optimizer
from train.model.assemble import (
    INDUCTOR_CACHE_ENV,
    TRITON_CACHE_ENV,
    assemble_model,
    fsdp_units,
    use_compile_cache,
)
from train.model.compile_plan import compile_plan_line, use_compile
from train.model.diffusion import SampleDraws, scheduler_kwargs
from train.model.kernels import is_compiled

# bf16 keeps 8 mantissa bits: a loss of ~1 computed through a bf16 U-Net differs from fp32 by ~1e-2
BF16_LOSS_RTOL = 2e-2


EPSILON = ("model.prediction_type=epsilon", "model.zero_terminal_snr=false")  # diffusers' SD2 recipe
EPSILON_CONFIG = tiny_config("unused", "unused", "unused", *EPSILON)


def model_and_batch(*switches: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    cfg = tiny_config("unused", "unused", "unused", *EPSILON, *switches)
    torch.manual_seed(0)
    model = assemble_model(cfg, "cpu", 0.5, torch.zeros(get_preset("tiny").text_shape()))
    batch = synthetic_latent_batch(get_preset("tiny"), 64, 4, resolve_device_setup("cpu", "fp32", False), 3)
    return model, batch


def diffusers_recipe_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """train_text_to_image.py's loss on the draws our objective takes from the batch's seeds."""
    from diffusers import DDPMScheduler

    objective = model.objective
    mean = batch[LATENT_MEAN]
    draws = SampleDraws.from_batch(batch, tuple(mean.shape[1:]), objective.num_timesteps)
    latents = objective.sample_latents(mean, batch[LATENT_LOGVAR], draws.latent_eps)
    scheduler = DDPMScheduler(**scheduler_kwargs(EPSILON_CONFIG.model))
    noisy = scheduler.add_noise(latents, draws.noise, draws.timesteps)
    text = objective.condition(batch, draws.coin)
    pred = model.unet(noisy, draws.timesteps, encoder_hidden_states=text).sample
    return F.mse_loss(pred.float(), draws.noise.float())


def our_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model.loss(model(batch), batch)


def test_loss_matches_diffusers_recipe_with_low_precision_norms() -> None:
    plain, batch = model_and_batch()
    low, _ = model_and_batch("model.low_precision_norms=true")
    with torch.no_grad():
        reference = diffusers_recipe_loss(plain, batch)
        assert torch.allclose(our_loss(plain, batch), reference, rtol=1e-5)
        assert our_loss(low, batch).item() == our_loss(plain, batch).item()  # fp32: the same computation
        with cpu_autocast_like_cuda():  # bf16 autocast with CUDA's fp32 norms, as a GPU run
            amp_plain, amp_low = diffusers_recipe_loss(plain, batch), our_loss(low, batch)
    assert torch.allclose(amp_plain, reference, rtol=BF16_LOSS_RTOL)
    assert torch.allclose(amp_low, reference, rtol=BF16_LOSS_RTOL), (amp_low, reference)


COMPILED = ("model.low_precision_norms=true", "compile=true", "compile_backend=aot_eager")


@pytest.mark.parametrize("keep", [False, True], ids=["", "keep_channels_last"])
@pytest.mark.parametrize("scope", ["unet", "blocks"])
def test_compiled_step_with_the_switches_has_no_breaks_recompiles_or_readbacks(
    scope: str, keep: bool
) -> None:
    """Both compile scopes: no graph break, nothing compiled after the first step, no read-back, and the
    step's loss and gradients are the eager step's (aot_eager runs the same ATen ops). Blocks: every block
    is its own graph (transformer blocks recompile per instance in the first step, by design). In the GPU
    layout (channels_last; no FSDP, so the 4-D conv kernels are NHWC too); with model.keep_channels_last
    too (its GroupNorm, attention-output and convolution hooks change layouts, not values)."""
    switches = (*COMPILED, f"compile_scope={scope}", "channels_last=true")  # the GPU layout, NHWC weights
    switches += ("model.keep_channels_last=true",) if keep else ()
    model, batch = model_and_batch(*switches)
    eager, _ = model_and_batch(*COMPILED[:1])  # NCHW, uncompiled
    cfg = tiny_config("unused", "unused", "unused", *switches)
    optimizer = build_optimizer(cfg, model)
    setup = resolve_device_setup("cpu", "fp32", False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for m in (model, eager):
        our_loss(m, batch).backward()  # the first compiles forward and backward
    first = {k: v.grad.clone() for k, v in model.named_parameters()}
    assert all(torch.allclose(first[k], v.grad, rtol=1e-4, atol=1e-6) for k, v in eager.named_parameters())
    assert is_compiled(model.unet) and (scope == "blocks") == (model.unet._compiled_call_impl is None)
    assert list(model.state_dict()) == list(eager.state_dict())  # checkpoints, EMA, export: same names
    kernels = [w for w in model.unet.parameters() if w.dim() == 4]
    assert kernels and all(w.is_contiguous(memory_format=torch.channels_last) for w in kernels)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    recompiles = sum(torch._dynamo.utils.counters["recompiles"].values())
    with count_readbacks() as counts:
        for _ in range(2):
            train_step(model, optimizer, batch, setup)
    assert counts.by_step == {}
    assert graphs >= 1 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompiles
    assert not torch._dynamo.utils.counters["graph_break"]
    assert sum(torch._dynamo.utils.counters["recompiles"].values()) == recompiles
    if scope == "unet":
        assert recompiles == 0 and graphs == 1  # the whole tiny U-Net, forward and backward in one graph
    else:
        # one graph per block at most: same-shape ResNet blocks share one in NCHW (11 for 12), not all in
        # NHWC, where their inputs' strides differ (12; narrow SD2: 31 NCHW, 34 NHWC for 38 blocks)
        assert 0 < graphs <= len(fsdp_units(model.unet))


def test_sd2_recipes_compile_on_gpu_only_and_the_plan_says_what_it_costs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.config import load_config
    from train.config import TrainConfig

    cfg = load_config(TrainConfig, "sd2-base-256", [f"save_folder={tmp_path}"], kind="train")
    assert cfg.compile is None and cfg.model.low_precision_norms and cfg.compile_cache_dir
    assert use_compile(cfg, "gpu") and not use_compile(cfg, "cpu")
    line = compile_plan_line(cfg, "gpu", 256)
    assert "first step also compiles" in line and "per FSDP unit" in line and cfg.compile_cache_dir in line
    assert "whole U-Net as one graph" in compile_plan_line(cfg)  # one GPU: fsdp null trains it unwrapped
    single = load_config(TrainConfig, "sd2-base-256", [f"save_folder={tmp_path}", "fsdp=false"], kind="train")
    assert "whole U-Net as one graph" in compile_plan_line(single)
    regional = load_config(
        TrainConfig,
        "sd2-base-256",
        [f"save_folder={tmp_path}", "fsdp=false", "compile_scope=blocks"],
        kind="train",
    )
    assert "block as its own graph" in compile_plan_line(regional)
    tiny = tiny_config("unused", "unused", "unused")
    assert not use_compile(tiny, "gpu") and compile_plan_line(tiny) == ""
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.delenv(TRITON_CACHE_ENV, raising=False)
    folder = use_compile_cache(str(tmp_path / "cache"))
    assert os.environ[INDUCTOR_CACHE_ENV] == folder and Path(folder).is_dir()
    assert os.environ[TRITON_CACHE_ENV] == str(Path(folder) / "triton")


def test_compile_mode_reaches_torch_compile_and_cuda_graphs_refuse_what_they_cannot_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile_mode is passed to torch.compile as inductor's `mode` (spied: inductor on CPU is minutes of
    C++, and CUDA graphs need a GPU: tests/train/loop/test_gpu.py runs them). Refused up front, naming the
    fix: a mode with a backend that has none, CUDA graphs under FSDP, and CUDA graphs with gradient
    accumulation (the train job at start and the dry-run plan)."""
    from shared.config import ConfigError, load_config
    from shared.launch.plan import LaunchOptions
    from train.config import TrainConfig
    from train.launch import plan_train
    from train.model.compile_plan import check_cuda_graphs

    seen: list[dict[str, object]] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: seen.append(options))
    graphs = ("compile=true", "compile_backend=inductor", "compile_mode=reduce-overhead")
    model_and_batch(*graphs)
    assert seen == [{"backend": "inductor", "dynamic": False, "mode": "reduce-overhead"}]
    seen.clear()
    model_and_batch("compile=true", "compile_backend=aot_eager")
    assert seen == [{"backend": "aot_eager", "dynamic": False}]  # default: no mode argument at all

    with pytest.raises(ConfigError, match="has no modes: pass compile_backend=inductor"):
        tiny_config("unused", "unused", "unused", "compile_backend=aot_eager", "compile_mode=max-autotune")
    with pytest.raises(ConfigError, match="pass fsdp=false"):
        tiny_config("unused", "unused", "unused", *graphs, "fsdp=true")
    autotuned = tiny_config(
        "unused", "unused", "unused", "fsdp=true", "compile_mode=max-autotune-no-cudagraphs"
    )
    assert not autotuned.uses_cuda_graphs()

    cfg = tiny_config("unused", "unused", "unused", *graphs)
    check_cuda_graphs(cfg, "gpu", 1)
    with pytest.raises(ConfigError, match="set device_microbatch_size to the per-rank batch"):
        check_cuda_graphs(cfg, "gpu", 2)
    check_cuda_graphs(tiny_config("unused", "unused", "unused", *graphs[1:]), "cpu", 2)  # compile off on CPU
    assert "mode reduce-overhead (each graph captured as a CUDA graph" in compile_plan_line(cfg)

    recipe = [f"save_folder={tmp_path}", "fsdp=false", "compile_mode=reduce-overhead"]
    accumulating = plan_train(
        "sd2-base-256", [*recipe, "device_microbatch_size=4"], LaunchOptions(8, "local")
    )
    assert any("cannot accumulate gradients over microbatches" in why for why in accumulating.refusals)
    single = load_config(TrainConfig, "sd2-base-256", [*recipe, "device_microbatch_size=256"], kind="train")
    assert single.uses_cuda_graphs() and "CUDA graph" in compile_plan_line(single)
