"""Gradient-norm clipping, the same as Composer's `GradientClipping(clipping_type="norm")`, without its
per-step walk over the model, and with the scaling folded into a fused optimizer step.

Composer's algorithm finds the parameters (or, under FSDP, the root FSDP modules) anew on every step and
asks `state.fsdp_enabled`, which walks every module again. The model's parameters and FSDP units do not
change during a run, so they are looked up once.

Clipping is a norm (one read of every gradient) and a scale (a read and a write of every gradient). With
torch's fused AdamW (optimizer.fused) the scale costs nothing: its kernel already reads every gradient and
divides it by `optimizer.grad_scale` when that is set (the hook AMP's GradScaler uses), so this sets
`grad_scale = 1 / clip_coef` for exactly the next step and skips the separate pass. The result equals
torch's `clip_grad_norm_` to float rounding (a divide, not a multiply; tests/train/loop/test_clipping.py).
On the tiny CPU bench that pass was ~0.5-0.9 ms of the ~1.7 ms clipping took per step (CPU foreach kernels
loop per tensor, 208 gradients). The norm itself is three dispatches (`total_grad_norm`): torch's
`get_total_norm` moves each per-tensor norm to the first device with its own `.to`, one host dispatch per
gradient even on one device (686 a step for SD2-base: a quarter of the compiled H200 step's top-level ops).

Under FSDP the same three dispatches give each rank the norm of its own gradients (shards, with a sharded
strategy); their squares are summed over the FSDP process group with one all-reduce, as FSDP's
`clip_grad_norm_` does. FSDP's own method takes one `vector_norm` per gradient and scales each gradient with
its own `mul_` and `.to`: 2,224 dispatches a step on rank 0 of 2 gloo ranks at SD2-base's module tree (443
gradients after a backward), and with NO_SHARD (one GPU) it hands over to torch's `clip_grad_norm_` (695).
Here it is about ten for any number of gradients, and the scale folds into the fused step as above.

It scales the gradients itself where the step cannot: AMP fp16 (GradScaler owns `grad_scale`), an
optimizer that is not fused, or one that holds other parameters. Several FSDP roots in one model clip
each its own tree with FSDP's method, as Composer does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from composer.core import Algorithm, Event, Precision, State
from composer.loggers import Logger
from torch.distributed.fsdp import FullyShardedDataParallel

GRAD_SCALE = "grad_scale"  # the attribute torch's fused Adam/AdamW divide gradients by, if not None


@dataclass
class ClipTargets:
    model: torch.nn.Module
    params: list[torch.nn.Parameter]  # the trainable parameters (FSDP's original ones under FSDP)
    # under FSDP with a sharded strategy: the parameters whose gradients each rank holds a shard of; the
    # squares of their local norms are summed over `group`
    sharded: list[torch.nn.Parameter] = field(default_factory=list)
    whole: list[torch.nn.Parameter] = field(default_factory=list)  # the rest: whole on every rank
    group: Any = None
    fsdp_roots: list[FullyShardedDataParallel] = field(default_factory=list)  # several roots: FSDP's own


def sharded_by_fsdp(root: FullyShardedDataParallel) -> set[int]:
    """ids of the parameters whose gradients FSDP shards over the ranks, decided as FSDP's own
    `clip_grad_norm_` decides it (its flat parameters' handles; one rank always runs NO_SHARD)."""
    ids: set[int] = set()
    for handle in root._all_handles:
        if handle.uses_sharded_strategy:
            params = handle.flat_param._params if handle._use_orig_params else [handle.flat_param]
            ids.update(id(p) for p in params or [])
    return ids


def clip_targets(model: torch.nn.Module) -> ClipTargets:
    roots = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel) and m.check_is_root()]
    params = [p for p in model.parameters() if p.requires_grad]
    if len(roots) > 1:
        return ClipTargets(model, [], fsdp_roots=roots)
    if not roots:
        return ClipTargets(model, params, whole=params)
    sharded_ids = sharded_by_fsdp(roots[0])
    sharded = [p for p in params if id(p) in sharded_ids]
    whole = [p for p in params if id(p) not in sharded_ids]
    return ClipTargets(model, params, sharded, whole, roots[0].process_group if sharded else None)


def steps_exactly(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> bool:
    """The optimizer updates exactly `params` (a grad_scale set on it scales no other gradient)."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    return len(held) == len(params) and {id(p) for p in held} == {id(p) for p in params}


def folds_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Its next step runs torch's fused kernel, which divides every gradient by `grad_scale`. Checked per
    step: loading an optimizer state dict replaces the param groups, `fused` flag included."""
    return getattr(optimizer, "_step_supports_amp_scaling", False) and all(
        group.get("fused") for group in optimizer.param_groups
    )


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all `grads` together, as `torch.nn.utils.get_total_norm` computes it (the same foreach
    norms, stacked in the same order), in three dispatches where the gradients share a device and dtype;
    otherwise torch's own."""
    # plain dense tensors on one device in one dtype: get_total_norm's one foreach group (not DTensors). One
    # set comprehension: a generator over SD2's 686 gradients was 687 Python calls a step.
    kinds = {(type(g), g.layout, g.device, g.dtype) for g in grads}
    if len(kinds) != 1 or type(grads[0]) is not torch.Tensor or grads[0].layout != torch.strided:
        return torch.nn.utils.get_total_norm(grads)
    with torch.no_grad():
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)


def global_grad_norm(targets: ClipTargets) -> torch.Tensor | None:
    """The L2 norm of all the targets' gradients over every rank. Sharded gradients: each rank's squared
    norm, summed over the FSDP group by one all-reduce (on the device: no host sync), as FSDP's
    `clip_grad_norm_` computes it; no sharding: `total_grad_norm`, torch's value bit for bit. None: no
    gradient to clip (a sharded rank holding none still joins the all-reduce)."""
    whole = [p.grad for p in targets.whole if p.grad is not None]
    if not targets.sharded:
        return total_grad_norm(whole) if whole else None
    shards = [p.grad for p in targets.sharded if p.grad is not None]  # None where this rank holds none
    with torch.no_grad():
        if shards:
            squared = total_grad_norm(shards).square()
        else:
            squared = torch.zeros((), dtype=torch.float32, device=targets.sharded[0].device)
        dist.all_reduce(squared, group=targets.group)
        if whole:
            squared = squared + total_grad_norm(whole).square()
        return squared.sqrt()


def clear_grad_scale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step post-hook: a clipping scale applies to the one step it was computed for."""
    setattr(optimizer, GRAD_SCALE, None)


class GradNormClipping(Algorithm):
    """Scale the gradients so their global L2 norm is at most `max_norm`, after the last microbatch."""

    def __init__(self, max_norm: float):
        self.max_norm = max_norm
        self.targets: ClipTargets | None = None
        self.fold_into: torch.optim.Optimizer | None = None  # the one optimizer, over exactly these params
        self.hooked: set[int] = set()  # optimizers whose steps clear grad_scale

    def match(self, event: Event, state: State) -> bool:
        return event == Event.AFTER_TRAIN_BATCH

    def apply(self, event: Event, state: State, logger: Logger) -> Any:
        self.clip_step(state)
        return None

    def clip_step(self, state: State) -> None:
        """Clip the gradients of `state.model` for its next optimizer step."""
        # Looked up at the first step, after Composer's wrapping and FSDP's lazy init (`check_is_root`).
        if self.targets is None or self.targets.model is not state.model:
            self.look_up_targets(state)
        assert self.targets is not None
        for root in self.targets.fsdp_roots:
            root.clip_grad_norm_(max_norm=self.max_norm)
        if self.targets.params:
            self.clip(self.targets, state)

    def look_up_targets(self, state: State) -> None:
        self.targets = clip_targets(state.model)
        optimizers = list(state.optimizers)
        self.fold_into = None
        if self.targets.params and len(optimizers) == 1 and steps_exactly(optimizers[0], self.targets.params):
            self.fold_into = optimizers[0]
            if id(self.fold_into) not in self.hooked:
                self.fold_into.register_step_post_hook(clear_grad_scale)
                self.hooked.add(id(self.fold_into))

    def clip(self, targets: ClipTargets, state: State) -> None:
        total = global_grad_norm(targets)
        if total is None:
            return
        fp16 = Precision(state.precision) == Precision.AMP_FP16  # GradScaler sets grad_scale itself
        if fp16 or self.fold_into is None or not folds_scale(self.fold_into):
            torch.nn.utils.clip_grads_with_norm_(targets.params, self.max_norm, total)
            return
        # clip_grads_with_norm_'s coefficient, as the divisor the fused step applies (no host sync)
        coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
        setattr(self.fold_into, GRAD_SCALE, coef.reciprocal())
