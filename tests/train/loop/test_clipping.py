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
from train.loop.clipping import GRAD_SCALE, GradNormClipping
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
