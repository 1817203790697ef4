"""The anatomy section of `make bench`: the train step of the bench's recipe taken apart at one resolution
(ops.py, compiled.py, memory.py), then each speed switch in `anatomy.variants` timed on its own."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from shared.estimate.cluster import state_update
from shared.presets import get_preset
from shared.runtime.device import DeviceSetup
from train.bench.anatomy.compiled import compile_anatomy, conv_backward_layouts
from train.bench.anatomy.memory import activation_bytes_per_image, batch_per_gpu
from train.bench.anatomy.ops import (
    UPDATE_PHASES,
    DispatchTally,
    FullStep,
    cpu_autocast_like_cuda,
    dispatch_tally,
)
from train.bench.anatomy.profile import profile_steps
from train.bench.config import BenchConfig
from train.bench.step import FlopCounts, StepBench, mfu, progress, synthetic_latent_batch, time_calls
from train.config import TrainConfig
from train.loop.clipping import folds_scale
from train.model.assemble import forget_compiled_code
from train.model.compile_plan import use_compile
from train.model.layout import keep_channels_last

WARMUP_STEPS = 2  # a variant's untimed steps: compilation, optimizer state, cuDNN autotuning, allocator


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def full_step(
    recipe: TrainConfig,
    setup: DeviceSetup,
    resolution: int,
    batch_size: int,
    seed: int,
    bucket: tuple[int, int] | None = None,
) -> FullStep:
    """The recipe's model and optimizer on the device, one fixed batch (at a bucket's shape if given),
    clipping and EMA as the job runs."""
    torch.manual_seed(seed)
    bench = StepBench(recipe, setup, online=False)
    preset = get_preset(recipe.model.preset)
    batch = synthetic_latent_batch(preset, resolution, batch_size, setup, seed, bucket)
    clip = recipe.optimizer.grad_clip_norm
    return FullStep.build(bench.model, bench.optimizer, batch, setup, clip, recipe.ema.enabled)


# The shipped SD2 recipes' sharding (jobs/train/sd2-base-*.yaml) on the published 256 GPUs.
FSDP_RANKS, FSDP_STRATEGY = 256, "SHARD_GRAD_OP"


def memory_section(step: FullStep, recipe: TrainConfig, resolution: int, batch_size: int, seed: int) -> Any:
    """Activation bytes per image and the batch per GPU type it allows: on one GPU (no FSDP), and under
    the shipped recipes' FSDP on 256 ranks."""
    preset = get_preset(recipe.model.preset)
    small = synthetic_latent_batch(preset, resolution, 1, step.setup, seed)
    large = synthetic_latent_batch(preset, resolution, 1 + max(batch_size, 1), step.setup, seed)
    # On CPU under CUDA's bf16 autocast policy, as shared/estimate/memory.py's table was measured (memory.py
    # measure_recipe); the train job never autocasts on CPU, so fp32 here would overstate a GPU's bytes.
    region = cpu_autocast_like_cuda() if step.setup.device.type == "cpu" else nullcontext()
    with region:
        per_image = activation_bytes_per_image(step.model, small, large, step.setup)
    params = sum(p.numel() for p in step.model.unet.parameters())
    return {
        "activation_bytes_per_image": per_image,
        "unet_params": params,
        "batch_per_gpu": {
            "one_gpu": batch_per_gpu(per_image, params, 1, "DDP"),
            f"{FSDP_STRATEGY}_{FSDP_RANKS}_ranks": batch_per_gpu(
                per_image, params, FSDP_RANKS, FSDP_STRATEGY
            ),
        },
    }


def bench_anatomy(cfg: BenchConfig, recipe: TrainConfig, setup: DeviceSetup) -> dict[str, Any]:
    """Eager step: dispatch counts, bytes, profile by phase and family, memory; then the compiled step
    (anatomy.compile_backend), then the variants."""
    plan = cfg.anatomy
    res, batch_size = cfg.anatomy_resolution(), cfg.anatomy_batch()
    eager = dataclasses.replace(recipe, compile=False)  # the recipe's switches, compile measured apart
    step = full_step(eager, setup, res, batch_size, cfg.seed)
    step.run()  # optimizer state, allocator
    out: dict[str, Any] = {"resolution": res, "batch_size": batch_size}
    tally = dispatch_tally(step, plan.cpu_autocast_proxy)
    out["eager"] = (
        tally.to_json() | state_update_counts(step, tally) | profile_steps(step, plan.profile_steps)
    )
    out["eager"]["autocast_proxy"] = plan.cpu_autocast_proxy and setup.kind == "cpu"
    out["memory"] = memory_section(step, recipe, res, batch_size, cfg.seed)
    if plan.compile_backend:
        unet = step.model.unet
        compiled = compile_anatomy(
            unet, step.run, setup.sync, plan.compile_backend, plan.compile_steps, plan.compile_cache_dir
        )
        profiled = profile_steps(step, 1)
        compiled["top_level_aten_ops_per_step"] = profiled["top_level_aten_ops_per_step"]
        out["compiled"] = compiled
        forget_compiled_code()
    del step
    _free()
    if plan.conv_layouts:
        out["conv_backward_layouts"] = layout_section(recipe, setup, res, cfg.seed)
    return out


def state_update_counts(step: FullStep, tally: DispatchTally) -> dict[str, Any]:
    """The state update's bytes per U-Net parameter as counted (clipping, optimizer and EMA phases), beside
    shared/estimate/cluster.py's formula for the same step (EMA, if any, every step as FullStep runs it), the
    dry-run plan prices DDP against FSDP with."""
    params = sum(p.numel() for p in step.model.unet.parameters())
    counted = sum(tally.bytes_by_phase[phase] for phase in UPDATE_PHASES)
    ema = 1 if step.ema is not None else None
    formula = state_update(params, 1, "DDP", clipping=step.clipping is not None, ema_interval=ema)
    priced = folds_scale(step.optimizer)  # the formula's AdamW is torch's fused kernel
    return {
        "state_update_bytes_per_param": counted / params,
        "state_update_formula_bytes_per_param": formula.bytes_per_param if priced else None,
    }


def layout_section(recipe: TrainConfig, setup: DeviceSetup, resolution: int, seed: int) -> dict[str, Any]:
    """What the compiled step's backward hands cuDNN in the GPU layout (channels_last, whatever this device
    runs; low-precision norms), batch 1: without and with model.keep_channels_last (train/model/layout.py)."""
    nhwc = dataclasses.replace(setup, channels_last=True)
    out: dict[str, Any] = {"recipe_keeps_channels_last": recipe.model.keep_channels_last}
    for name, keep in (("without", False), ("keep_channels_last", True)):
        model = dataclasses.replace(recipe.model, keep_channels_last=keep, low_precision_norms=True)
        eager = dataclasses.replace(recipe, compile=False, channels_last=True, model=model)
        step = full_step(eager, nhwc, resolution, 1, seed)
        if keep:  # assemble_model applies it to compiled runs only; this step compiles below
            keep_channels_last(step.model.unet)
        out[name] = conv_backward_layouts(step.model.unet, step.run)
        del step
        _free()
    return out


def proxies(step: FullStep, variant: TrainConfig, cpu_autocast_proxy: bool) -> dict[str, Any]:
    """A variant's dispatch counts (eager variants only: a dispatch mode under a compiled U-Net would
    count what dynamo traces, not what runs)."""
    if use_compile(variant, step.setup.kind):
        return {}
    tally = dispatch_tally(step, cpu_autocast_proxy).to_json()
    keys = (
        "aten_ops_computing",
        "bytes_moved",
        "fp32_bytes_under_autocast",
        "fp32_bytes_under_autocast_by_family",
    )
    return {key: tally[key] for key in keys}


# inductor's count of compiled graphs it ran without capturing them (the log says why: a CPU tensor, an
# input mutated in place, ...); only then is a compile_mode=reduce-overhead variant not what it says
CUDAGRAPH_SKIPS = "cudagraph_skips"


def graphs_skipped(variant: TrainConfig, kind: str) -> dict[str, int]:
    """A variant that captures CUDA graphs: how many graphs inductor left uncaptured (every one on CPU)."""
    if not (variant.uses_cuda_graphs() and use_compile(variant, kind)):
        return {}
    return {CUDAGRAPH_SKIPS: int(torch._dynamo.utils.counters["inductor"][CUDAGRAPH_SKIPS])}


def bench_variants(
    cfg: BenchConfig,
    recipe: TrainConfig,
    setup: DeviceSetup,
    recipe_with: Callable[[list[str]], TrainConfig],
    flops: dict[int, FlopCounts],
    peak: float | None,
) -> dict[str, Any]:
    """Per resolution: the full step (clipping and EMA included) of the recipe and of each variant, with
    images/s, MFU and the gain over anatomy.baseline (a variant's name, or "recipe")."""
    plan = cfg.anatomy
    runs = {"recipe": recipe, **{name: recipe_with(list(o)) for name, o in plan.variants.items()}}
    out: dict[str, Any] = {}
    for res in cfg.step.resolutions:
        batch_size = cfg.step.batch_for(res)
        timed: dict[str, Any] = {}
        for name, variant in runs.items():
            forget_compiled_code()
            torch._dynamo.utils.counters["inductor"].pop(CUDAGRAPH_SKIPS, None)
            progress(f"anatomy {res} px: {name} (a compiled variant compiles first) ...")
            step = full_step(variant, setup, res, batch_size, cfg.seed)
            first = time_calls(step.run, 0, 1, setup).median  # a compiled variant compiles in it
            seconds = time_calls(step.run, WARMUP_STEPS - 1, plan.variant_repeats, setup).median
            profiled = profile_steps(step, 1)
            rate = batch_size / seconds
            timed[name] = {
                "overrides": list(plan.variants.get(name, [])),
                "first_step_s": first,
                "step_s": seconds,
                "images_per_s_per_device": rate,
                "mfu": mfu(flops[res].unet_train_step, rate, peak),
                "top_level_aten_ops_per_step": profiled["top_level_aten_ops_per_step"],
                # on a GPU: which kernels ran (e.g. whose attention: a cached graph would show the old one)
                **{k: profiled[k] for k in ("top_kernels_s", "device_seconds_per_step") if k in profiled},
                **proxies(step, variant, plan.cpu_autocast_proxy),
                **graphs_skipped(variant, setup.kind),
            }
            del step
            _free()
        base = timed[plan.baseline]["step_s"]
        for entry in timed.values():
            entry["gain"] = base / entry["step_s"]
        out[str(res)] = timed
    return out
