"""Activation memory per image, measured: the bytes the step's forward saves for backward (each storage
once) at batch b and 2b, the difference over b. Weights saved for backward are in both and cancel. Then
the batch per GPU that fits each GPU type of the planner's table (shared/estimate/memory.py).

`python -m train.bench.anatomy.memory` re-measures that table (ACTIVATION_BYTES_PER_IMAGE) on this machine's
CPU: each shipped GPU recipe's model, eager, under CPU bf16 autocast with CUDA's policy for the norms and
attention (ops.py `cpu_autocast_like_cuda`). Which tensors autograd saves, their shapes and dtypes, do not
depend on the device once the dtypes are CUDA's, so the bytes are what a GPU saves (not what its allocator
adds: the planner keeps a share of memory back for that).
"""

from __future__ import annotations

from typing import Any

import torch

from shared.config import load_config
from shared.contract import LATENT_MEAN
from shared.estimate import GPU_TABLE
from shared.estimate.memory import MEASURED_RECIPES, Strategy, batch_that_fits
from shared.presets import get_preset
from shared.runtime.device import DeviceSetup
from train.bench.anatomy.ops import cpu_autocast_like_cuda
from train.bench.step import build_diffusion_model, synthetic_latent_batch
from train.config import TrainConfig
from train.model.diffusion import DiffusionModel


def saved_bytes(model: DiffusionModel, batch: dict[str, torch.Tensor], setup: DeviceSetup) -> int:
    """Bytes of distinct storages autograd keeps for backward in one forward + loss of `batch`."""
    seen: dict[tuple[Any, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), setup.autocast():
        loss = model.loss(model(batch), batch)
    del loss
    return sum(seen.values())


def activation_bytes_per_image(
    model: DiffusionModel, small: dict[str, torch.Tensor], large: dict[str, torch.Tensor], setup: DeviceSetup
) -> float:
    """(saved bytes at the large batch - at the small one) / the batch difference."""
    images, fewer = len(large[LATENT_MEAN]), len(small[LATENT_MEAN])
    return (saved_bytes(model, large, setup) - saved_bytes(model, small, setup)) / (images - fewer)


def batch_per_gpu(per_image: float, params: int, world_size: int, strategy: Strategy) -> dict[str, Any]:
    """For each GPU type the planner knows: the batch per GPU that fits (shared/estimate/memory.py)."""
    return {
        name: batch_that_fits(spec.memory_gb, per_image, params, world_size, strategy).to_json()
        for name, spec in GPU_TABLE.items()
        if spec.memory_gb and per_image > 0
    }


CPU = DeviceSetup(torch.device("cpu"), "cpu", "cpu", "fp32", channels_last=False)
SEED = 0


def measure_recipe(config: str, overrides: tuple[str, ...] = (), images: int = 1) -> tuple[str, int, float]:
    """(preset, resolution, activation bytes per image) of a train recipe's model on this CPU, eager, under
    CUDA's bf16 autocast policy (module doc); batch `images` vs 2 x `images`."""
    cfg = load_config(TrainConfig, config, [*overrides, "compile=false"], kind="train")
    torch.manual_seed(SEED)
    model = build_diffusion_model(cfg, CPU)
    preset, res = get_preset(cfg.model.preset), cfg.data.resolution
    small = synthetic_latent_batch(preset, res, images, CPU, SEED)
    large = synthetic_latent_batch(preset, res, 2 * images, CPU, SEED)
    with cpu_autocast_like_cuda():
        per_image = activation_bytes_per_image(model, small, large, CPU)
    return cfg.model.preset, res, per_image


def main() -> None:
    """Print the table shared/estimate/memory.py keeps, measured afresh (its MEASURED_RECIPES)."""
    for config, overrides in MEASURED_RECIPES:
        preset, res, per_image = measure_recipe(config, overrides)
        print(
            f'    ("{preset}", {res}): {per_image:_.0f},  # {config} {" ".join(overrides)}'.rstrip(),
            flush=True,
        )


if __name__ == "__main__":
    main()
