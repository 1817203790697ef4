"""How the U-Net's GPU kernels are picked: cuDNN autotuning for the run's fixed shapes, TF32 matmuls as every
train run has them, and torch.compile's graphs under per-block FSDP against dynamo's recompile limit.

- cuDNN: a training run feeds the U-Net one shape (the resolution and microbatch are fixed, the loader drops
  the last partial batch), so `torch.backends.cudnn.benchmark` times each convolution's algorithms once and
  keeps the fastest for the rest of the run. Sample renders add a few more shapes, each timed once.
- TF32: Composer's GPU device turns on `torch.backends.cuda.matmul.allow_tf32` in every train run (its
  `DeviceGPU`). `make bench`'s step sections build no Composer device, so they compiled and timed the U-Net
  without it. Inductor keys its on-disk cache on that flag, so on the H200 the bench's Composer section missed
  the cache the step section had just filled and compiled cold again. Both now set it here, before the first
  compile: the bench times the program a train run runs, and one cache serves both.
- compile under FSDP: FSDP breaks the compiled U-Net's graph at every FSDP unit (each ResNet and
  transformer block, train/model/assemble.py `is_fsdp_unit`), and dynamo compiles each unit's `forward` into
  one code object's cache: once per distinct shape for ResNet blocks, and once per instance for transformer
  blocks (their guards check the attention processor's identity, `___check_obj_id(...attn1.processor)`).
  SD2-base has 22 ResNet and 16 transformer blocks. Counted on CPU with SD2's block structure at narrow
  widths (dynamo's `CompileCounter`, forward and backward): 30 graphs with the limit out of the way; at
  dynamo's default `recompile_limit` of 8 only 22, and the other 8 transformer blocks silently run eagerly
  ("hit config.recompile_limit"). `fit_recompile_limit` raises the limit to the largest number of instances
  of one unit class (an upper bound on one code object's entries), with a warning naming the setting, before
  the first compile; tests/train/model/test_kernels.py shows the fallback and the fix.
"""

from __future__ import annotations

import collections
import logging

import torch

from train.model.assemble import fsdp_units

log = logging.getLogger(__name__)


# scaled_dot_product_attention's CUDA backends by TrainConfig.attention_backend name: (is on, turn on / off)
_cuda = torch.backends.cuda
SDPA_BACKENDS = {
    "cudnn": (_cuda.cudnn_sdp_enabled, _cuda.enable_cudnn_sdp),
    "flash": (_cuda.flash_sdp_enabled, _cuda.enable_flash_sdp),
    "efficient": (_cuda.mem_efficient_sdp_enabled, _cuda.enable_mem_efficient_sdp),
    "math": (_cuda.math_sdp_enabled, _cuda.enable_math_sdp),
}


def attention_backends_enabled() -> set[str]:
    return {name for name, (enabled, _) in SDPA_BACKENDS.items() if enabled()}


def use_gpu_kernel_settings(device: str, attention_backend: str = "auto") -> None:
    """cuDNN autotuning (fixed shapes) and TF32 matmuls on a GPU run, as Composer's GPU device sets them
    (module doc), and the attention kernels `attention_backend` names; nothing on CPU."""
    if device == "gpu":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        use_attention_backend(attention_backend)


def use_attention_backend(name: str) -> None:
    """auto: every backend allowed, torch picks (cuDNN's on an H100 / H200 with torch 2.11, whose backward
    was the costliest kernel of the 512 px step there); else only `name`, so SDPA raises where that backend
    cannot run a shape instead of quietly falling back. Global flags, set before the first compile: dynamo
    traces the backend they select into the graph."""
    for backend, (_, enable) in SDPA_BACKENDS.items():
        enable(name in ("auto", backend))


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module FSDP wraps (Composer replaces `model.unet` with its FSDP root), else the module itself."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return module.module if isinstance(module, FullyShardedDataParallel) else module


def is_compiled(unet: torch.nn.Module) -> bool:
    """Whether `nn.Module.compile` compiled this U-Net (or, compile_scope=blocks, its FSDP units), before or
    after FSDP wrapped it (the wrapper's own `_compiled_call_impl` is None: FSDP wraps the compiled module,
    it does not copy the attribute)."""
    inner = unwrapped(unet)
    if getattr(inner, "_compiled_call_impl", None) is not None:
        return True
    units = fsdp_units(inner)
    return bool(units) and all(getattr(m, "_compiled_call_impl", None) is not None for m in units)


def unit_instances(unet: torch.nn.Module) -> collections.Counter[str]:
    """FSDP units per class: each instance is one cache entry of its class's compiled forward."""
    return collections.Counter(type(m).__name__ for m in fsdp_units(unet))


def max_graphs_under_fsdp(unet: torch.nn.Module) -> int:
    """At most the graphs a compiled, per-block FSDP-wrapped U-Net makes: one per FSDP unit, plus the U-Net's
    own piece outside them (units of the same class and shape may share one: SD2's 38 units make 30)."""
    return sum(unit_instances(unet).values()) + 1


def fit_recompile_limit(unet: torch.nn.Module, fsdp: bool, compile: bool) -> str:
    """Raise dynamo's recompile limit to the most instances of one FSDP unit class when a compiled U-Net is
    wrapped per block; returns the warning it logged ("" when nothing had to change)."""
    if not (fsdp and compile):
        return ""
    needed = max(unit_instances(unet).values(), default=0)
    limit = torch._dynamo.config.recompile_limit
    if needed <= limit:
        return ""
    torch._dynamo.config.recompile_limit = needed
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, max_graphs_under_fsdp(unet)
    )
    warning = (
        f"compile=true under per-block FSDP compiles each of {dict(unit_instances(unet))} block instances "
        f"separately, over dynamo's recompile_limit of {limit}: blocks past it would run eagerly. Raised "
        f"torch._dynamo.config.recompile_limit to {needed} (set it yourself, or compile=false, to change)"
    )
    log.warning(warning)
    return warning
