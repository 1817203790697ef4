"""GradNormClipping folds its scale into the fused AdamW step, and that step equals torch's clipping followed
by the same step, to float rounding; where the step cannot fold it, the gradients are scaled as before."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from composer.core import Event

from shared.presets import get_preset
from tests.train.conftest import tiny_config
from train.bench.anatomy.profile import is_top_level_aten
from train.loop.clipping import GRAD_SCALE, GradNormClipping, total_grad_norm
from train.loop.trainer import build_optimizer
from train.model.assemble import assemble_model

STEPS = 3


def tiny_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def backward(net: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    inputs, targets = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen) * 10
    net.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(net(inputs), targets).backward()


def state_of(net: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str = "fp32") -> Any:
    return SimpleNamespace(model=net, optimizers=[optimizer], precision=precision)


def adamw(net: torch.nn.Module, fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01, fused=fused or None)


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "does-not-clip"])
def test_folded_step_equals_clip_then_step(max_norm: float) -> None:
    ours, reference = tiny_net(), tiny_net()
    opt, ref_opt = adamw(ours, fused=True), adamw(reference, fused=False)
    clipping = GradNormClipping(max_norm)
    for step in range(STEPS):
        backward(ours, step)
        backward(reference, step)
        clipping.apply(Event.AFTER_TRAIN_BATCH, state_of(ours, opt), logger=None)  # type: ignore[arg-type]
        assert getattr(opt, GRAD_SCALE) is not None, "folded: the step scales"
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        opt.step()
        ref_opt.step()
        assert getattr(opt, GRAD_SCALE) is None, "the scale is for one step only"
    for ours_p, ref_p in zip(ours.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours_p, ref_p, rtol=1e-5, atol=1e-6)


def test_the_clipped_gradient_is_what_the_step_leaves_behind() -> None:
    """The fused kernel writes the divided gradient back: after the step .grad is the clipped gradient."""
    net = tiny_net()
    opt = adamw(net, fused=True)
    backward(net, 0)
    raw = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    GradNormClipping(0.05).apply(Event.AFTER_TRAIN_BATCH, state_of(net, opt), logger=None)  # type: ignore[arg-type]
    opt.step()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in raw]))
    for p, g in zip(net.parameters(), raw, strict=True):
        torch.testing.assert_close(p.grad, g * (0.05 / (norm + 1e-6)))


def unfoldable_cases() -> dict[str, Any]:
    def not_fused(net: torch.nn.Module) -> Any:
        return state_of(net, adamw(net, fused=False))

    def resumed_from_an_unfused_state_dict(net: torch.nn.Module) -> Any:
        opt = adamw(net, fused=True)
        old = adamw(copy.deepcopy(net), fused=False)
        opt.load_state_dict(old.state_dict())  # the saved groups win, `fused` included
        return state_of(net, opt)

    def fp16_grad_scaler(net: torch.nn.Module) -> Any:
        return state_of(net, adamw(net, fused=True), precision="amp_fp16")

    def optimizer_over_other_params(net: torch.nn.Module) -> Any:
        extra = torch.nn.Parameter(torch.zeros(3))
        opt = torch.optim.AdamW([*net.parameters(), extra], fused=True)
        return state_of(net, opt)

    cases = (not_fused, resumed_from_an_unfused_state_dict, fp16_grad_scaler, optimizer_over_other_params)
    return {f.__name__: f for f in cases}


@pytest.mark.parametrize("case", list(unfoldable_cases()))
def test_scales_the_gradients_itself_where_the_step_cannot(case: str) -> None:
    net = tiny_net()
    state = unfoldable_cases()[case](net)
    backward(net, 0)
    GradNormClipping(0.05).apply(Event.AFTER_TRAIN_BATCH, state, logger=None)  # type: ignore[arg-type]
    assert getattr(state.optimizers[0], GRAD_SCALE, None) is None
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in net.parameters()]))
    assert norm.item() == pytest.approx(0.05, rel=1e-4)


def test_the_train_job_builds_a_fused_adamw() -> None:
    cfg = tiny_config("unused", "unused", "unused")
    model = assemble_model(cfg, "cpu", 1.0, torch.zeros(get_preset("tiny").text_shape()))
    assert all(group["fused"] for group in build_optimizer(cfg, model).param_groups)
    cfg = tiny_config("unused", "unused", "unused", "optimizer.fused=false")
    assert not any(group["fused"] for group in build_optimizer(cfg, model).param_groups)


def random_grads(count: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(count)
    return [torch.randn(1 + 7 * i % 50, 3, generator=gen).to(dtype) for i in range(count)]


def test_the_total_norm_is_torchs_bit_for_bit() -> None:
    grads = random_grads(60)
    assert torch.equal(total_grad_norm(grads), torch.nn.utils.get_total_norm(grads))
    mixed = [*random_grads(5), *random_grads(4, torch.bfloat16)]  # two groups: torch's own path
    assert torch.equal(total_grad_norm(mixed), torch.nn.utils.get_total_norm(mixed))


def top_level_aten_ops(run: Any) -> int:
    """ATen ops called from Python, as the profiler records them (a no-op `.to` included: it still
    goes through the dispatcher, which a TorchDispatchMode does not see)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for e in prof.events() if is_top_level_aten(e))


def clipping_ops(layers: int, fused: bool) -> int:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    state = state_of(net, adamw(net, fused=fused))
    net(torch.randn(4, 8)).square().sum().backward()
    clipping = GradNormClipping(1e-3)
    clipping.look_up_targets(state)
    targets = clipping.targets
    assert targets is not None
    return top_level_aten_ops(lambda: clipping.clip(targets, state))


@pytest.mark.parametrize("fused", [True, False], ids=["folded", "scaled"])
def test_clipping_dispatches_the_same_ops_for_any_number_of_gradients(fused: bool) -> None:
    """The host's work per step must not grow with the parameter count (SD2-base: 686 gradients):
    torch's get_total_norm dispatches one `.to` per gradient."""
    counts = [clipping_ops(layers, fused) for layers in (2, 40)]
    assert counts[0] == counts[1] <= 10, counts
