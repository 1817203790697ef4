"""Activation memory per image, measured: the bytes the step's forward saves for backward (each storage
once) at batch b and 2b, the difference over b. Weights saved for backward are in both and cancel. Then
the batch per GPU that fits each GPU type of the planner's table (shared/estimate/memory.py)."""

from __future__ import annotations

from typing import Any

import torch

from shared.contract import LATENT_MEAN
from shared.estimate import GPU_TABLE
from shared.estimate.memory import Strategy, batch_that_fits
from shared.runtime.device import DeviceSetup
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
