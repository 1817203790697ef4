"""model.keep_channels_last (train/model/layout.py): the compiled U-Net's activations stay channels_last,
values unchanged. The count it is for (convolution backwards fed NCHW tensors) is `make bench`'s
anatomy.conv_backward_layouts (tests/train/bench/test_bench.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.config import ConfigError
from shared.presets import get_preset
from tests.train.conftest import tiny_config
from train.model.assemble import assemble_model
from train.model.layout import LayoutKeepingGroupNorm, group_norm_keeping_layout


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_group_norm_keeping_layout_is_atens_group_norm_in_the_inputs_layout(
    layout: torch.memory_format,
) -> None:
    torch.manual_seed(0)
    x = (torch.randn(2, 32, 6, 5) * 3 + 1).to(memory_format=layout)
    weight, bias = torch.randn(32), torch.randn(32)
    got = group_norm_keeping_layout(x, 8, weight, bias, 1e-5)
    assert torch.allclose(got, F.group_norm(x, 8, weight, bias, 1e-5), atol=1e-5)
    assert got.is_contiguous(memory_format=layout) and got.dtype == x.dtype
    low = group_norm_keeping_layout(x.bfloat16(), 8, weight.bfloat16(), bias.bfloat16(), 1e-5)
    reference = F.group_norm(
        x.bfloat16().float(), 8, weight.bfloat16().float(), bias.bfloat16().float(), 1e-5
    )
    assert low.dtype == torch.bfloat16 and low.is_contiguous(memory_format=layout)
    assert torch.allclose(low.float(), reference, atol=3e-2)  # statistics in fp32, one bf16 rounding
    assert torch.allclose(group_norm_keeping_layout(x, 8, None, None, 1e-5), F.group_norm(x, 8), atol=1e-5)


def _unet_norms(*switches: str) -> list[type]:
    cfg = tiny_config("unused", "unused", "unused", "model.low_precision_norms=true", *switches)
    model = assemble_model(cfg, "cpu", 0.5, torch.zeros(get_preset("tiny").text_shape()))
    return [type(m) for m in model.unet.modules() if isinstance(m, torch.nn.GroupNorm)]


def test_it_applies_to_compiled_channels_last_runs_only() -> None:
    keep = ("model.keep_channels_last=true",)
    compiled = ("compile=true", "compile_backend=aot_eager", "channels_last=true")
    assert set(_unet_norms(*keep, *compiled)) == {LayoutKeepingGroupNorm}
    assert LayoutKeepingGroupNorm not in _unet_norms(*keep, "channels_last=true")  # eager: ATen's kernel
    assert LayoutKeepingGroupNorm not in _unet_norms(*keep, "compile=true", "compile_backend=aot_eager")
    assert LayoutKeepingGroupNorm not in _unet_norms(*compiled)  # off by default


def test_it_needs_the_low_precision_norms_it_rewrites() -> None:
    with pytest.raises(ConfigError, match=r"model\.low_precision_norms=true"):
        tiny_config(
            "unused", "unused", "unused", "model.keep_channels_last=true", "model.low_precision_norms=false"
        )
