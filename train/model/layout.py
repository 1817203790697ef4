"""Keep the compiled U-Net's activations channels_last end to end (`model.keep_channels_last`).

With `channels_last` the U-Net's inputs and conv kernels are NHWC, but some ops hand back NCHW:
- GroupNorm: ATen's CUDA kernel is NCHW-only, and the decomposition inductor traces it through reshapes
  the input to (N, G, -1), a copy for an NHWC tensor, so the graph records its output as NCHW;
- diffusers' Transformer2DModel ends in `.permute(0, 3, 1, 2).contiguous()`: NCHW again after every
  attention block, and through the skip connections in every up block.
Inductor hands `aten.convolution_backward` (an ATen fallback) its tensors at the strides the graph records,
and cuDNN converts each NCHW one to the NHWC it runs in: on the H200 (sixth run) those copies took 7% of
the step at 256 and 512 px, all under `aten::convolution_backward`. Counted on CPU in the tiny U-Net's
compiled backward (`train/bench/anatomy/compiled.py` `conv_backward_layouts`): most of its convolution
backwards got an NCHW gradient or input.

Here, applied to compiled channels_last runs only (eager runs keep ATen's one-kernel GroupNorm):
- GroupNorm under compile is written as reductions over a grouped view, a view for NHWC and NCHW alike, so
  every op after it keeps the input's layout (statistics in fp32, as ATen's kernel accumulates them);
- each convolution's input is made channels_last (after an attention block's NCHW output, or diffusers'
  `.contiguous()` before the ResNet shortcut), and the gradient flowing back into it too (a slice of a
  concatenation's gradient is neither layout), so the copies cuDNN would make become inductor's, fusable
  with the ops that produce those tensors.
In the tiny U-Net's compiled backward this takes the convolution backwards fed an NCHW gradient or input
from 5 and 11 of 25 to none. Identity in value (GroupNorm to within fp32 rounding of ATen's). Not yet timed
on a GPU, so off by default: `make bench BENCH=full`'s `keep_channels_last` variant measures it.
"""

from __future__ import annotations

from typing import Any

import torch

from shared.norms import LowPrecisionGroupNorm


def group_norm_keeping_layout(
    x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """`F.group_norm` whose output has `x`'s memory layout and dtype (statistics and affine in fp32)."""
    n, c = x.shape[:2]
    # splitting C (stride 1 in NHWC, the outermost non-batch dim in NCHW) into (G, C/G) is a view either way
    grouped = x.reshape(n, groups, c // groups, *x.shape[2:]).float()
    var, mean = torch.var_mean(grouped, dim=tuple(range(2, grouped.dim())), keepdim=True, correction=0)
    y = ((grouped - mean) * torch.rsqrt(var + eps)).reshape(x.shape)
    per_channel = (1, c) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.float().reshape(per_channel)
    if bias is not None:
        y = y + bias.float().reshape(per_channel)
    return y.to(x.dtype)


class LayoutKeepingGroupNorm(LowPrecisionGroupNorm):
    """`LowPrecisionGroupNorm` that, while torch.compile traces it, keeps its input's memory layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return super().forward(x)
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        with torch.autocast(kind, enabled=False):
            return group_norm_keeping_layout(x.to(dtype), self.num_groups, self.weight, self.bias, self.eps)


class _GradientChannelsLast(torch.autograd.Function):
    """Identity forward; the gradient flowing back is made channels_last (a slice of a concatenation's
    gradient is neither layout: cuDNN would copy it itself, here inductor can fuse the copy)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous(memory_format=torch.channels_last)


def _conv_input_channels_last(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: a convolution's input in channels_last (diffusers calls `.contiguous()` on the
    ResNet shortcut's input, which makes it NCHW)."""
    return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])


def _conv_gradient_channels_last(_module: Any, _args: Any, output: torch.Tensor) -> torch.Tensor:
    return _GradientChannelsLast.apply(output)


def keep_channels_last(unet: torch.nn.Module) -> dict[str, int]:
    """Swap the U-Net's low-precision GroupNorms for the layout-keeping one, and hook every 2-D convolution's
    input and output gradient, in place (state dict and checkpoints unchanged); returns how many of each."""
    counts = {"group_norms": 0, "convolutions": 0}
    for module in unet.modules():
        if type(module) is LowPrecisionGroupNorm:
            module.__class__ = LayoutKeepingGroupNorm
            counts["group_norms"] += 1
        elif isinstance(module, torch.nn.Conv2d):
            module.register_forward_pre_hook(_conv_input_channels_last)
            module.register_forward_hook(_conv_gradient_channels_last)
            counts["convolutions"] += 1
    return counts
