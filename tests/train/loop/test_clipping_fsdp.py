"""GradNormClipping under FSDP, on 2 CPU ranks with PyTorch's own FSDP over gloo: for every sharding strategy
the job offers, it leaves the gradients and weights FSDP's own `clip_grad_norm_` leaves (to float rounding),
folded into the fused AdamW step or not, and dispatches the same few ops however many gradients a rank holds
(FSDP's method: four per gradient, or torch's `clip_grad_norm_` with one `.to` per gradient under NO_SHARD).
Beside it, each rank's whole state update (clipping, fused AdamW, sharded EMA lerp), counted byte by byte
as `make bench` counts it: the 48 bytes a parameter shared/estimate/cluster.py `state_update` prices, over
the rank's own shard under SHARD_GRAD_OP and FULL_SHARD, over every parameter under NO_SHARD (as DDP).

One spawn of 2 ranks runs every case; a failure in a rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from composer.core import Event
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from shared.estimate.cluster import state_update
from tests.train.loop.test_clipping import top_level_aten_ops
from train.bench.anatomy.ops import UPDATE_PHASES, DispatchTally, TallyMode
from train.ema.sharded import ShardedEMAStore
from train.loop.clipping import GRAD_SCALE, GradNormClipping

RANKS = 2
STEPS = 3
MAX_NORM = 0.05  # well under the gradients' norm: every step clips
STRATEGIES = ("SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD")  # train/config/job.py fsdp_sharding_strategy


def net(layers: int) -> nn.Module:
    """Uneven widths: some ranks hold none of a parameter (empty shards, grad None)."""
    torch.manual_seed(0)
    widths = [5, 7, 3, *([6] * (layers - 3)), 2][: layers + 1]
    return nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(widths)])


def wrap(model: nn.Module, strategy: str) -> FullyShardedDataParallel:
    def each_linear(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or isinstance(module, nn.Linear)

    return FullyShardedDataParallel(
        model, device_id=torch.device("cpu"), auto_wrap_policy=each_linear,
        sharding_strategy=ShardingStrategy[strategy], use_orig_params=True,
    )  # fmt: skip


def backward(model: nn.Module, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * rank + step)  # each rank its own data, as data parallel
    inputs = torch.randn(8, 5, generator=gen)
    model.zero_grad(set_to_none=True)
    (model(inputs) * 10).square().sum().backward()


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    return SimpleNamespace(model=model, optimizers=[optimizer], precision="fp32")


def assert_same(ours: list[torch.Tensor | None], theirs: list[torch.Tensor | None], what: str) -> None:
    assert len(ours) == len(theirs), what
    for a, b in zip(ours, theirs, strict=True):
        assert (a is None) == (b is None), what
        if a is not None and b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=what)


def clips_as_fsdp_does(strategy: str, fused: bool, rank: int) -> None:
    ours, theirs = wrap(net(4), strategy), wrap(net(4), strategy)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=fused or None)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, fused=False)
    clipping = GradNormClipping(MAX_NORM)
    what = f"{strategy}, {'folded' if fused else 'scaled'}, rank {rank}"
    for step in range(STEPS):
        backward(ours, rank, step)
        backward(theirs, rank, step)
        clipping.apply(Event.AFTER_TRAIN_BATCH, state_of(ours, opt), logger=None)  # type: ignore[arg-type]
        norm = theirs.clip_grad_norm_(MAX_NORM)
        assert norm > 2 * MAX_NORM, "the case must clip"
        if fused:
            assert getattr(opt, GRAD_SCALE) is not None, f"{what}: the fused step scales"
        else:
            grads = [p.grad for p in ours.parameters()], [p.grad for p in theirs.parameters()]
            assert_same(*grads, f"{what}: clipped gradients, step {step}")
        opt.step()
        their_opt.step()
        # the fused kernel writes the divided gradients back: after the step they are the clipped ones
        assert_same([p.grad for p in ours.parameters()], [p.grad for p in theirs.parameters()], what)
        assert getattr(opt, GRAD_SCALE, None) is None, "the scale is for one step only"
    assert_same(list(ours.parameters()), list(theirs.parameters()), f"{what}: weights")


def clipping_ops(strategy: str, layers: int) -> tuple[int, int]:
    """Top-level ATen ops of one clipping of a model of `layers` Linear units: ours, FSDP's own."""
    ours, theirs = wrap(net(layers), strategy), wrap(net(layers), strategy)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=True)
    clipping = GradNormClipping(MAX_NORM)
    for model in (ours, theirs):
        backward(model, dist.get_rank(), 0)
    clipping.look_up_targets(state_of(ours, opt))  # type: ignore[arg-type]
    targets = clipping.targets
    assert targets is not None
    counts = (
        top_level_aten_ops(lambda: clipping.clip(targets, state_of(ours, opt))),  # type: ignore[arg-type]
        top_level_aten_ops(lambda: theirs.clip_grad_norm_(MAX_NORM)),
    )
    dist.barrier()
    return counts


def state_update_bytes(strategy: str, rank: int) -> tuple[float, int, int]:
    """Bytes of one clipping + fused AdamW step + EMA lerp on this rank, the parameters it updates, and the
    model's: 4 Linear(256, 256) units, so the per-tensor scalars (step counts, the norm) are noise."""
    torch.manual_seed(0)
    model = wrap(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]), strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    clipping, ema = GradNormClipping(MAX_NORM), ShardedEMAStore(model)
    for _ in range(2):  # the first builds the optimizer state
        tally = DispatchTally()
        model.zero_grad(set_to_none=True)
        (model(torch.randn(8, 256)) * 10).square().sum().backward()
        with TallyMode(tally):
            with tally.label("clipping"):
                clipping.apply(Event.AFTER_TRAIN_BATCH, state_of(model, opt), logger=None)  # type: ignore[arg-type]
            with tally.label("optimizer"):
                opt.step()
            with tally.label("ema"):
                ema.lerp(model, 0.99)
    held = sum(p.numel() for p in model.parameters())  # outside forward and backward: this rank's shard
    dist.barrier()
    return sum(tally.bytes_by_phase[phase] for phase in UPDATE_PHASES), held, 4 * (256 * 256 + 256)


def rank_main(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS)
    try:
        for strategy in STRATEGIES:
            for fused in (True, False):
                clips_as_fsdp_does(strategy, fused, rank)
            small, large = clipping_ops(strategy, 4), clipping_ops(strategy, 16)
            assert small[0] == large[0] <= 12, f"{strategy}: ours {small[0]} vs {large[0]} ops"
            assert large[1] > 2 * large[0], f"{strategy}: FSDP's own {large[1]} ops vs ours {large[0]}"
            moved, held, params = state_update_bytes(strategy, rank)
            update = state_update(params, RANKS, strategy, clipping=True, ema_interval=1)
            assert held == pytest.approx(update.params_per_rank, rel=0.01), f"{strategy}: {held} of {params}"
            assert moved == pytest.approx(update.per_rank_bytes, rel=0.01), f"{strategy}: {moved / held} B"
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_clipping_under_fsdp_equals_fsdps_own_in_a_fixed_number_of_ops_and_the_update_is_sharded(
    tmp_path: Path,
) -> None:
    mp.spawn(rank_main, args=(str(tmp_path / "pg-store"),), nprocs=RANKS, join=True)
