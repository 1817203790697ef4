"""The anatomy's byte count (train/bench/anatomy/ops.py): what an op reads and writes, in-place and foreach
ops included, and the state update of the job's step against the planner's formula."""

from __future__ import annotations

import pytest
import torch

from shared.runtime.device import resolve_device_setup
from train.bench.anatomy.ops import DispatchTally, TallyMode, dispatch_tally
from train.bench.anatomy.section import full_step, state_update_counts
from train.launch import load_train_config

N = 1000  # fp32 elements a tensor: 4,000 bytes


def tally_of(fn) -> DispatchTally:  # type: ignore[no-untyped-def]
    tally = DispatchTally()
    with TallyMode(tally):
        fn()
    return tally


def moved(tally: DispatchTally) -> int:
    return sum(tally.bytes_by_family.values())


def test_each_op_counts_what_it_reads_and_what_it_writes_once() -> None:
    a, b = torch.ones(N), torch.ones(N)
    assert moved(tally_of(lambda: a + b)) == 3 * 4 * N  # two reads, a new output
    assert moved(tally_of(lambda: a.add_(b))) == 3 * 4 * N  # returns self: written once, not twice
    xs, ys = [torch.ones(N) for _ in range(3)], [torch.ones(N) for _ in range(3)]
    # returns nothing: the schema's mutable list is what it writes
    assert moved(tally_of(lambda: torch._foreach_lerp_(xs, ys, 0.5))) == 3 * 3 * 4 * N


def test_fused_adamw_stores_the_gradient_only_given_a_grad_scale() -> None:
    """torch's fused kernel writes back the unscaled gradient when it divides by a grad_scale (the folded
    clipping) and leaves it alone otherwise, though its schema marks `grads` mutable both times."""

    def step(grad_scale: torch.Tensor | None) -> int:
        param = torch.nn.Parameter(torch.ones(N))
        param.grad = torch.ones(N)
        optimizer = torch.optim.AdamW([param], fused=True)
        optimizer.step()  # state exists
        if grad_scale is not None:
            optimizer.grad_scale = grad_scale  # what train/loop/clipping.py sets
        tally = tally_of(optimizer.step)
        return tally.bytes_by_family["optimizer"]

    # param, grad, exp_avg, exp_avg_sq read; param and both moments written (+ the step counters, scalars)
    assert step(None) == pytest.approx(7 * 4 * N, abs=64)
    assert step(torch.ones(())) == pytest.approx(8 * 4 * N, abs=64)


@pytest.mark.parametrize(
    ("overrides", "bytes_per_param"),
    [
        ([], 48),
        (["optimizer.grad_clip_norm=null"], 40),
        (["ema.enabled=false"], 36),
        (["optimizer.fused=false"], None),
    ],
)
def test_the_jobs_state_update_is_counted_as_the_planner_prices_it(
    overrides: list[str], bytes_per_param: int | None
) -> None:
    """The tiny preset's full step as the job runs it (clipping folded into the fused AdamW, EMA every
    step): its clipping, optimizer and EMA phases move the formula's bytes per U-Net parameter."""
    recipe = load_train_config("sd2-base-256", ["model.preset=tiny", "device=cpu", *overrides])
    step = full_step(recipe, resolve_device_setup("cpu", "fp32", False), 64, 2, 0)
    step.run()
    tally = dispatch_tally(step)
    counts = state_update_counts(step, tally)
    assert counts["state_update_formula_bytes_per_param"] == bytes_per_param
    if bytes_per_param is not None:
        assert counts["state_update_bytes_per_param"] == pytest.approx(bytes_per_param, rel=0.001)
    else:  # foreach AdamW and clipping's own scaling pass: more passes over the same tensors, no formula
        assert counts["state_update_bytes_per_param"] == pytest.approx(108, rel=0.001)
