"""shared/norms.py: GroupNorm / LayerNorm in the autocast dtype, swapped in place (issue 30)."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from shared.norms import LowPrecisionGroupNorm, count_low_precision_norms, use_low_precision_norms


class OwnNorm(torch.nn.GroupNorm):
    """A subclass with its own behaviour (like diffusers' AdaGroupNorm): never swapped."""


def block() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.GroupNorm(4, 16), torch.nn.SiLU(),
        torch.nn.Flatten(2), torch.nn.LayerNorm(64), OwnNorm(2, 16),
    )  # fmt: skip


def test_swap_keeps_names_and_is_exact_outside_autocast() -> None:
    plain, swapped = block(), block()
    assert use_low_precision_norms(swapped) == {"LowPrecisionGroupNorm": 1, "LowPrecisionLayerNorm": 1}
    assert count_low_precision_norms(swapped) == 2 and type(swapped[5]) is OwnNorm
    assert list(plain.state_dict()) == list(swapped.state_dict())
    x = torch.randn(2, 8, 8, 8)
    assert torch.equal(plain(x), swapped(x))  # fp32: the parent's forward, bit for bit


def test_under_autocast_the_norms_run_in_its_dtype_close_to_fp32() -> None:
    plain, swapped = block(), block()
    use_low_precision_norms(swapped)
    x = torch.randn(2, 8, 8, 8)
    fp32_norm = plain[1](plain[0](x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = swapped[1](swapped[0](x))
    assert low.dtype == torch.bfloat16
    assert (low.float() - fp32_norm).abs().max() < 0.05  # bf16 rounding of values ~N(0, 1)
    assert isinstance(swapped[1], LowPrecisionGroupNorm)


def test_compiles_without_graph_breaks_or_recompiles() -> None:
    swapped = block()
    use_low_precision_norms(swapped)
    counter = CompileCounter()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # process-wide: an earlier test's compiles counted there too
    compiled = torch.compile(swapped, backend=counter)
    x = torch.randn(2, 8, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):
            compiled(x)
    compiled(x)  # outside autocast: the other branch is a second graph, not a break
    assert counter.frame_count == 2
    assert not torch._dynamo.utils.counters["graph_break"]
