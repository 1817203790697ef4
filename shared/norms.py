"""GroupNorm and LayerNorm in the autocast dtype (`low_precision_norms`), for the U-Net (train) and the VAE
(encode).

Under autocast torch runs `group_norm` and `layer_norm` in fp32 (both are on autocast's fp32 list): every
norm reads a bf16 / fp16 activation, writes an fp32 one twice its size, and the next convolution casts it
back. On CUDA the GroupNorm kernel is also NCHW-only, so a channels_last activation is copied to NCHW and back
around it (pytorch issue 111824). SD2's U-Net has 61 GroupNorms and 48 LayerNorms; its VAE encoder 21
GroupNorms. Running them in the autocast dtype halves their bytes and leaves one dtype in the graph for
inductor to fuse the norm with its SiLU and the casts around it. MosaicML's SD2 recipes train this way
(Composer's `LowPrecisionGroupNorm` / `LowPrecisionLayerNorm`, which these mirror without importing Composer:
encode must not).

Statistics are still accumulated in fp32 inside the kernels (ATen's GroupNorm and LayerNorm kernels use an
fp32 accumulator for bf16 / fp16 inputs); only the stored input and output are low precision.

The swap changes the class of the existing modules in place: parameter names, state dicts, checkpoints and
`save_pretrained` stay exactly as they were. Outside autocast (fp32 runs, every CPU run of the train job)
the forward is the parent class's own, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for `x`'s device, or None outside autocast."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


class LowPrecisionGroupNorm(torch.nn.GroupNorm):
    """`nn.GroupNorm` that runs in the autocast dtype under autocast (module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        if dtype is None:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            w, b = _cast(self.weight, dtype), _cast(self.bias, dtype)
            return F.group_norm(x.to(dtype), self.num_groups, w, b, self.eps)


class LowPrecisionLayerNorm(torch.nn.LayerNorm):
    """`nn.LayerNorm` that runs in the autocast dtype under autocast (module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        if dtype is None:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            w, b = _cast(self.weight, dtype), _cast(self.bias, dtype)
            return F.layer_norm(x.to(dtype), self.normalized_shape, w, b, self.eps)


SWAPS: dict[type[torch.nn.Module], type[torch.nn.Module]] = {
    torch.nn.GroupNorm: LowPrecisionGroupNorm,
    torch.nn.LayerNorm: LowPrecisionLayerNorm,
}


def use_low_precision_norms(model: torch.nn.Module) -> dict[str, int]:
    """Swap every plain GroupNorm / LayerNorm in `model` for its low-precision twin, in place (subclasses,
    e.g. diffusers' AdaGroupNorm, are left alone); returns how many of each were swapped."""
    swapped: dict[str, int] = {}
    for module in model.modules():
        target = SWAPS.get(type(module))
        if target is not None:
            module.__class__ = target
            swapped[target.__name__] = swapped.get(target.__name__, 0) + 1
    return swapped


def count_low_precision_norms(model: torch.nn.Module) -> int:
    return sum(isinstance(m, (LowPrecisionGroupNorm, LowPrecisionLayerNorm)) for m in model.modules())
