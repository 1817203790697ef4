"""The host's work in a step of the SD2 recipe as a run trains it, counted at SD2-base's module tree.

On an H200 (the sixth run) the recipe as run, at its 8 images per GPU, took 0.28-0.30 s a batch at 256 and
at 512 px, where the unwrapped step does 128 images at 256 px in 0.22 s: the device waited on the host. The
host's work per step follows the module tree, not the widths: every ATen op is dispatched and every Python
hook runs whatever the tensors' sizes. Preset `sd2-base-slim` is SD2-base's U-Net tree at a tenth of its
widths (the same 686 parameter tensors, 38 FSDP units, blocks and attention calls), so its step is mostly
host work, and on a CPU it can be counted. This section runs the recipe's own trainer on it, wrapped as a
run of the recipe wraps it (FSDP per block) and without FSDP, at the recipe's microbatch, and reports per
bare step the top-level ATen ops and Python calls, and Composer's batches timed as a run runs them: what
FSDP's per-block bookkeeping costs the host each step (PyTorch's FSDP with `use_orig_params` re-points
every parameter at a view of its flat parameter around each unit's forward and backward).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shared.presets import get_preset
from shared.runtime.device import DeviceSetup
from train.bench.config import HOST_TWIN_PRESET, BenchConfig, recipe_on
from train.bench.data import write_synthetic_dataset
from train.bench.step import progress
from train.bench.trainer.as_recipe import as_recipe_rows, bench_as_recipe
from train.bench.trainer.report import BARE, WRAPPED
from train.config import TrainConfig
from train.model.assemble import fsdp_units

RUNS = {WRAPPED: ["fsdp=true"], BARE: ["fsdp=false"]}
COUNTS = ("aten_ops_per_step", "python_calls_per_step")


def host_twin_recipe(cfg: BenchConfig, setup: DeviceSetup, work: Path, extra: list[str]) -> TrainConfig:
    """trainer.host_twin_recipe on the slim preset at trainer.host_twin_resolution, on this device, its U-Net
    compiled with trainer.host_twin_compile if set."""
    t = cfg.trainer
    compiled = ["compile=true", f"compile_backend={t.host_twin_compile}"] if t.host_twin_compile else []
    extra = [f"data.num_workers={cfg.loader.num_workers}", *compiled, *extra]
    return recipe_on(t.host_twin_recipe, HOST_TWIN_PRESET, t.host_twin_resolution, setup, work, extra)


def module_tree(preset: str) -> dict[str, int]:
    """Parameter tensors and FSDP units of the preset's U-Net (built on the meta device: no memory)."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**get_preset(preset).unet)
    return {"parameter_tensors": sum(1 for _ in unet.parameters()), "fsdp_units": len(fsdp_units(unet))}


def bench_host_twin(cfg: BenchConfig, setup: DeviceSetup, work: Path) -> dict[str, Any]:
    """The recipe as run at the slim preset with FSDP per block and without: host work per step each, and
    what FSDP adds (in all, per parameter tensor, and as a share of the batch on this host)."""
    t = cfg.trainer
    res = t.host_twin_resolution
    recipes = {name: host_twin_recipe(cfg, setup, work, extra) for name, extra in RUNS.items()}
    batch = recipes[WRAPPED].device_microbatch_size
    root = work / "host-twin-dataset"
    rows = as_recipe_rows(cfg.loader.rows, batch)
    write_synthetic_dataset(root, get_preset(HOST_TWIN_PRESET), res, rows, cfg.seed)
    tree = module_tree(HOST_TWIN_PRESET)
    out: dict[str, Any] = {
        "preset": HOST_TWIN_PRESET,
        "recipe": t.host_twin_recipe,
        "resolution": res,
        "batch_size": batch,
        **tree,
        "runs": {},
    }
    for name, recipe in recipes.items():
        progress(f"trainer host twin: {t.host_twin_recipe} at {HOST_TWIN_PRESET}, {res} px ({name}) ...")
        run = bench_as_recipe(
            recipe, root, res, t.warmup, t.flow_batches, work / f"host-{name}", setup, 0.0, None
        )
        out["runs"][name] = {
            "compiled": run["compiled"],
            "per_batch_s": run["per_batch_s"],
            "first_batch_s": run["first_batch_s"],
            "aten_ops_per_step": run["profile"]["top_level_aten_ops_per_step"],
            "python_calls_per_step": run["profile"]["python_calls_per_step"],
            # the same over whole Composer batches: clipping, the EMA, events and callbacks included
            "composer_batch": run["profile"]["composer_batch"],
        }
    wrapped, bare = out["runs"][WRAPPED], out["runs"][BARE]
    added = {key: wrapped[key] - bare[key] for key in COUNTS}
    out["fsdp_added"] = {
        **added,
        "per_parameter_tensor": {key: n / tree["parameter_tensors"] for key, n in added.items()},
        "share_of_batch": max(0.0, 1.0 - bare["per_batch_s"] / wrapped["per_batch_s"]),
    }
    return out
