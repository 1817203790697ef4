"""The trainer as the recipe runs it on a cluster, on one device.

The step sections time the U-Net unwrapped, at the bench's batch per device (128 at 256 px in `full`). A run
of the shipped SD2 recipes differs in three ways that all cost speed and none of which those sections see:
Composer wraps the U-Net in FSDP (one unit, and one compiled graph, per ResNet / transformer block, with bf16
parameters gathered for forward and backward); under FSDP the conv kernels stay NCHW in the flat parameters
while the activations are NHWC, so every convolution converts its kernel first (docs/gpu-path.md); and each
GPU runs its share of the global batch, 2048 / 256 = 8 images. This run is the recipe's own trainer with its
own FSDP settings and `device_microbatch_size`, one microbatch per step as on the recipe's cluster, timed as a
run runs it. One rank has nothing to shard (FSDP runs NO_SHARD), so communication is left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.runtime.device import DeviceSetup
from train.bench.step import mfu
from train.bench.trainer.batches import bench_trainer
from train.config import TrainConfig
from train.model.assemble import use_channels_last, weights_channels_last
from train.model.compile_plan import use_compile

PROFILE_STEPS = 2
AS_RECIPE = "as_recipe"  # the recipe as run; its variants are "as_recipe.<name>" (also precompile's units)


def as_recipe_overrides(variants: dict[str, list[str]]) -> dict[str, list[str]]:
    """The recipe as run and each trainer.as_recipe_variants entry: run name -> train overrides on top."""
    return {AS_RECIPE: [], **{f"{AS_RECIPE}.{name}": list(extra) for name, extra in variants.items()}}


def as_recipe_rows(loader_rows: int, microbatch: int) -> int:
    """Rows of the dataset the recipe as run reads: the data sections' count, two microbatches at least."""
    return max(loader_rows, 2 * microbatch)


def bench_as_recipe(
    recipe: TrainConfig,
    root: Path,
    resolution: int,
    warmup: int,
    flow_batches: int,
    work: Path,
    setup: DeviceSetup,
    flops_per_image: float,
    peak: float | None,
) -> dict[str, Any]:
    """`recipe` as the train job loads it on its cluster (fsdp decided: train/bench/config.py load_recipe):
    images/s and MFU of its Composer batches at its microbatch, and how the U-Net ran (wrapped, compiled,
    layout of the conv kernels)."""
    batch = recipe.device_microbatch_size
    fsdp = bool(recipe.fsdp)
    run = bench_trainer(
        recipe, root, resolution, batch, 1, warmup, work, setup, flow_batches, fsdp, PROFILE_STEPS
    )
    per_batch = run["flow"]["composer_per_batch_s"]
    rate = batch / per_batch
    return {
        "resolution": resolution,
        "batch_size": batch,
        "fsdp": fsdp,
        "fsdp_sharding_strategy": recipe.fsdp_sharding_strategy if fsdp else None,
        "compiled": use_compile(recipe, setup.kind),
        "channels_last": use_channels_last(recipe, setup.kind),  # the activations
        "conv_weights_channels_last": weights_channels_last(recipe, setup.kind),
        "first_batch_s": run["first_batch_s"],
        "per_batch_s": per_batch,
        "images_per_s_per_device": rate,
        "mfu": mfu(flops_per_image, rate, peak),
        "composer_outside_share": run["flow"]["outside_share"],
        # the bare step profiled: ATen ops launched per step; on a GPU its kernels and the device's busy
        # share (the sixth H200 run: 8 images per GPU ran at 27 img/s against 583 for 128 unwrapped)
        "profile": run["profile"],
    }
