"""Gradient-norm clipping, the same as Composer's `GradientClipping(clipping_type="norm")`, without its
per-step walk over the model.

Composer's algorithm finds the parameters (or, under FSDP, the root FSDP modules) anew on every step and
asks `state.fsdp_enabled`, which walks every module again. The model's parameters and FSDP units do not
change during a run, so they are looked up once; the clipping itself is torch's (`clip_grad_norm_`,
foreach kernels) or FSDP's own (`FullyShardedDataParallel.clip_grad_norm_`, which reduces the sharded norm
across ranks). On the tiny CPU model that clipping is most of the ~2 ms per step left (`make bench`):
CPU foreach kernels loop per tensor (~3 us each over 208 gradients), where a GPU runs one fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from torch.distributed.fsdp import FullyShardedDataParallel


@dataclass
class ClipTargets:
    model: torch.nn.Module
    fsdp_roots: list[FullyShardedDataParallel]  # under FSDP: the root units, which clip their whole tree
    params: list[torch.nn.Parameter]  # otherwise: the trainable parameters


def clip_targets(model: torch.nn.Module) -> ClipTargets:
    roots = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel) and m.check_is_root()]
    params = [] if roots else [p for p in model.parameters() if p.requires_grad]
    return ClipTargets(model, roots, params)


class GradNormClipping(Algorithm):
    """Scale the gradients so their global L2 norm is at most `max_norm`, after the last microbatch."""

    def __init__(self, max_norm: float):
        self.max_norm = max_norm
        self.targets: ClipTargets | None = None

    def match(self, event: Event, state: State) -> bool:
        return event == Event.AFTER_TRAIN_BATCH

    def apply(self, event: Event, state: State, logger: Logger) -> Any:
        # Looked up at the first step, after Composer's wrapping and FSDP's lazy init (`check_is_root`).
        if self.targets is None or self.targets.model is not state.model:
            self.targets = clip_targets(state.model)
        for root in self.targets.fsdp_roots:
            root.clip_grad_norm_(max_norm=self.max_norm)
        if self.targets.params:
            torch.nn.utils.clip_grad_norm_(self.targets.params, max_norm=self.max_norm)
        return None
