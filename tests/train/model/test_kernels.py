"""Issue 22 (5): torch.compile under per-block FSDP, on CPU (gloo, 1 rank, a counting dynamo backend instead
of inductor: which graphs dynamo makes does not depend on the backend).

- the compiled U-Net is seen as compiled through the FSDP wrapper Composer puts around it (the wrapper's
  own `_compiled_call_impl` is None: the GPU test's old assertion failed on it);
- one graph per FSDP unit plus one on the tiny U-Net (`max_graphs_under_fsdp`); with a recompile limit
  below its transformer blocks dynamo gives up on the rest (a hard error here), and `fit_recompile_limit`
  raises the limit so that every block compiles;
- SD2-base's block counts (22 ResNet, 16 transformer blocks) are over dynamo's default limit of 8.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp.wrap import CustomPolicy

from shared.presets import SD2_UNET
from train.bench.scale import microbatch_input, tiny_model
from train.model.assemble import is_fsdp_unit
from train.model.kernels import (
    SDPA_BACKENDS,
    attention_backends_enabled,
    fit_recompile_limit,
    is_compiled,
    max_graphs_under_fsdp,
    unit_instances,
    use_gpu_kernel_settings,
)


def fsdp_per_block(unet: torch.nn.Module) -> FullyShardedDataParallel:
    return FullyShardedDataParallel(
        unet, auto_wrap_policy=CustomPolicy(is_fsdp_unit), device_id=torch.device("cpu"),
        use_orig_params=True, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
    )  # fmt: skip


def test_sd2_blocks_exceed_the_default_recompile_limit() -> None:
    from diffusers import UNet2DConditionModel

    narrow = dict(SD2_UNET, block_out_channels=[40, 80, 160, 160], norm_num_groups=8, cross_attention_dim=32)
    unet = UNet2DConditionModel(**narrow)  # SD2-base's block structure at a fraction of its width
    assert unit_instances(unet) == {"ResnetBlock2D": 22, "Transformer2DModel": 16}
    assert max_graphs_under_fsdp(unet) == 39
    with torch._dynamo.config.patch(recompile_limit=8):
        assert fit_recompile_limit(unet, fsdp=False, compile=True) == ""  # not wrapped per block
        warning = fit_recompile_limit(unet, fsdp=True, compile=True)
        assert "recompile_limit of 8" in warning and torch._dynamo.config.recompile_limit == 22
    use_gpu_kernel_settings("cpu")
    assert not torch.backends.cudnn.benchmark  # a CPU run leaves cuDNN alone
    assert not torch.backends.cuda.matmul.allow_tf32


def test_gpu_settings_are_composers_so_the_bench_compiles_what_a_run_compiles() -> None:
    from composer.devices import DeviceGPU

    # What DeviceGPU's constructor sets before it asks CUDA for a device (composer/devices/device_gpu.py):
    # inductor's cache key holds the flag, so the bench must set it as every train run has it.
    assert inspect.signature(DeviceGPU).parameters["allow_tf32"].default is True
    use_gpu_kernel_settings("gpu")
    assert torch.backends.cudnn.benchmark and torch.backends.cuda.matmul.allow_tf32


def test_attention_backend_allows_only_the_named_kernels_and_auto_all_again() -> None:
    """A bench variant's backend must not outlive its model: the next one (auto) allows every backend."""
    use_gpu_kernel_settings("gpu", "flash")
    assert attention_backends_enabled() == {"flash"}
    use_gpu_kernel_settings("cpu", "cudnn")  # CPU runs leave the flags alone
    assert attention_backends_enabled() == {"flash"}
    use_gpu_kernel_settings("gpu", "auto")
    assert attention_backends_enabled() == set(SDPA_BACKENDS)


def compiled_tiny_under_fsdp(counted: CompileCounter) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_model()
    model.unet.compile(backend=counted)
    model.unet = fsdp_per_block(model.unet)
    return model


@pytest.mark.slow  # dynamo traces the tiny U-Net twice (~2 min on 2 loaded cores)
def test_compiled_unet_under_fsdp_makes_one_graph_per_unit_within_the_limit(one_rank_group: None) -> None:
    counted = CompileCounter()
    model = compiled_tiny_under_fsdp(counted)
    assert model.unet._compiled_call_impl is None and is_compiled(model.unet)
    unet = model.unet.module
    # each transformer block is its own cache entry of one code object (module doc of kernels.py)
    below = unit_instances(unet)["Transformer2DModel"] - 1
    inputs, _ = microbatch_input(2)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=below, fail_on_recompile_limit_hit=True):
        with pytest.raises(Exception, match=r"recompile_limit"):
            model(inputs)  # dynamo would leave the last transformer block eager
        torch._dynamo.reset()
        counted.clear()
        model = compiled_tiny_under_fsdp(counted)  # the failed forward left FSDP mid-gather
        assert "recompile_limit" in fit_recompile_limit(model.unet.module, fsdp=True, compile=True)
        model(inputs)
    # 13 graphs on torch 2.7 (the bound itself), 11 on torch 2.11 (fewer graph breaks; docs/gpu-tests.md);
    # what matters: every unit compiled (fail_on_recompile_limit_hit above) within the bound
    assert 0 < counted.frame_count <= max_graphs_under_fsdp(unet)


def test_sd2_blocks_compiled_one_by_one_all_compile_within_the_raised_limit() -> None:
    """compile_scope=blocks on SD2's block structure: all 38 blocks share one code object's cache
    (nn.Module._call_impl), 31 entries at dynamo's default limit of 8; compile_unet raises the limit, so no
    block falls back to eager (a hard error here), and identical blocks share a graph."""
    from diffusers import UNet2DConditionModel

    from tests.train.conftest import tiny_config
    from train.model.assemble import compile_unet, fsdp_units

    narrow = dict(SD2_UNET, block_out_channels=[40, 80, 160, 160], norm_num_groups=8, cross_attention_dim=32)
    unet = UNet2DConditionModel(**narrow)
    cfg = tiny_config("unused", "unused", "unused", "compile=true", "compile_scope=blocks", "fsdp=false")
    counted = CompileCounter()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        compile_unet(unet, cfg)
        for unit in fsdp_units(unet):  # count instead of generating code
            unit._compiled_call_impl = torch.compile(unit._call_impl, backend=counted, dynamic=False)
        with torch.no_grad():
            unet(torch.randn(1, 4, 32, 32), torch.tensor([10]), torch.randn(1, 77, 32))
        assert torch._dynamo.config.recompile_limit == 38
    assert is_compiled(unet) and unet._compiled_call_impl is None
    assert counted.frame_count == 31  # 22 ResNet blocks in 15 shapes + 16 transformer blocks, one each
