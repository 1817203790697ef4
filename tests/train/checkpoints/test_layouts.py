"""AdamW state resumed into a model of another memory layout (channels_last toggled) updates the right
elements: torch 2.7's fused AdamW walks moments by memory offset, so they are copied into their
parameter's layout after a load (train/checkpoints/layouts.py). The end-to-end resumes across layouts are in
test_gpu_path.py; this pins the kernel behaviour the fix exists for."""

from __future__ import annotations

import pytest
import torch

from train.checkpoints.layouts import conform_optimizer_state

SHAPE = (8, 3, 3, 3)  # a conv kernel: NCHW and NHWC memory orders differ
NHWC = torch.channels_last


def one_step(param_nhwc: bool, moments_nhwc: bool, fused: bool, conform: bool) -> tuple[torch.Tensor, int]:
    """One AdamW step from the same loaded state; returns (new weights in NCHW, state tensors conformed)."""
    gen = torch.Generator().manual_seed(0)
    weight, grad, avg = (torch.randn(SHAPE, generator=gen) for _ in range(3))
    avg_sq = torch.rand(SHAPE, generator=gen)

    def layout(t: torch.Tensor, nhwc: bool) -> torch.Tensor:
        return t.contiguous(memory_format=NHWC) if nhwc else t.clone()

    param = torch.nn.Parameter(layout(weight, param_nhwc))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=fused)
    moments = {"step": torch.tensor(3.0), "exp_avg": layout(avg, moments_nhwc),
               "exp_avg_sq": layout(avg_sq, moments_nhwc)}  # fmt: skip
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    optimizer.load_state_dict({"state": {0: moments}, "param_groups": [{**group, "params": [0]}]})
    copied = conform_optimizer_state([optimizer]) if conform else 0
    param.grad = layout(grad, param_nhwc)
    optimizer.step()
    return param.detach().contiguous(), copied


@pytest.mark.parametrize(("param_nhwc", "moments_nhwc"), [(False, True), (True, False)])
def test_moments_in_another_layout_are_conformed_before_the_fused_step(
    param_nhwc: bool, moments_nhwc: bool
) -> None:
    right, _ = one_step(param_nhwc, moments_nhwc, fused=False, conform=False)
    # torch 2.7, CPU: without the fix the fused step updates the wrong elements (0.38 and 0.43 off here).
    scrambled, _ = one_step(param_nhwc, moments_nhwc, fused=True, conform=False)
    assert float((scrambled - right).abs().max()) > 0.05
    fixed, copied = one_step(param_nhwc, moments_nhwc, fused=True, conform=True)
    assert copied == 2  # exp_avg and exp_avg_sq; the scalar step is left alone
    torch.testing.assert_close(fixed, right, rtol=1e-6, atol=1e-6)


def test_moments_in_the_parameters_layout_are_left_alone() -> None:
    for nhwc in (False, True):
        _, copied = one_step(nhwc, nhwc, fused=True, conform=True)
        assert copied == 0
