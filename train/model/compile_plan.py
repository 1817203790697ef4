"""Whether a run compiles its U-Net, and the dry-run plan's line about it; torch-free, so the launch plan
(train/launch.py) can say it without importing torch."""

from __future__ import annotations

import math

from shared.config import ConfigError
from train.config import TrainConfig


def use_compile(cfg: TrainConfig, device: str) -> bool:
    """`compile` as asked, or (null) on GPU only: it pays there, and costs minutes of C++ compiling on CPU."""
    if cfg.compile is None:
        return device == "gpu"
    return cfg.compile


def cuda_graph_refusal(cfg: TrainConfig, device: str, grad_accum: int) -> str:
    """Why this run cannot capture CUDA graphs ("" when it can, or does not try): a replay writes its
    outputs, the parameters' gradients among them, into the memory the previous replay used, so a gradient
    accumulated over microbatches would be overwritten (torch then raises on reading it)."""
    if not (cfg.uses_cuda_graphs() and use_compile(cfg, device)) or grad_accum <= 1:
        return ""
    return (
        f"compile_mode={cfg.compile_mode} captures CUDA graphs, which cannot accumulate gradients over "
        f"microbatches ({grad_accum} per step here): set device_microbatch_size to the per-rank batch, or "
        "compile_mode=default / max-autotune-no-cudagraphs"
    )


def check_cuda_graphs(cfg: TrainConfig, device: str, grad_accum: int) -> None:
    if why := cuda_graph_refusal(cfg, device, grad_accum):
        raise ConfigError(why)


def compile_plan_line(
    cfg: TrainConfig, device: str = "gpu", world_size: int = 1, parameter_bytes: float | None = None
) -> str:
    """The dry-run plan's line for a compiled run ("" when the run stays eager): the first step also compiles
    the U-Net's forward and backward, where the kernels are cached, and where to read the measured time.
    `parameter_bytes`: the U-Net's fp32 gradients, which DDP (no FSDP, several ranks) buckets."""
    if not use_compile(cfg, device):
        return ""
    graphs = "one graph per FSDP unit (each ResNet / transformer block) plus the glue between them"
    if not cfg.uses_fsdp(world_size):
        graphs = "the whole U-Net as one graph"
        if cfg.compile_scope == "blocks":
            graphs = "each ResNet / transformer block as its own graph, one per shape (the glue eager)"
        elif world_size > 1:
            graphs = _ddp_split(cfg.ddp_bucket_cap_mb, parameter_bytes)
    if cfg.compile_mode != "default":
        graphs += f", mode {cfg.compile_mode}"
        if cfg.uses_cuda_graphs():
            graphs += " (each graph captured as a CUDA graph on its first steps)"
    cache = cfg.compile_cache_dir or "inductor's default per-node /tmp folder (set compile_cache_dir)"
    return (
        f"compile ({cfg.compile_backend}): the first step also compiles the U-Net's forward and backward, "
        f"{graphs}; {COLD_COMPILE_SEEN}; `make bench BENCH=full` prints its first_step_s per resolution; "
        f"restarts and other ranks reuse the kernels cached in {cache}"
    )


MB = 1024 * 1024
FIRST_BUCKET_MB = 1.0  # DDP's and DDPOptimizer's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def ddp_graphs(parameter_bytes: float, bucket_cap_mb: float) -> int:
    """About how many graphs dynamo's DDPOptimizer splits a compiled model into: one per gradient bucket,
    the first of 1 MB (counted on 2 gloo ranks, slim SD2 tree, 32.5 MB: 3 at 25 MB, 9 at 4 MB)."""
    rest = max(0.0, parameter_bytes - FIRST_BUCKET_MB * MB)
    return 1 + math.ceil(rest / (bucket_cap_mb * MB))


def _ddp_split(bucket_cap_mb: float, parameter_bytes: float | None) -> str:
    """DDPOptimizer splits the compiled U-Net at each of DDP's gradient buckets (train/loop/compiled.py)."""
    split = f"split by DDP at each {bucket_cap_mb:g} MB gradient bucket (ddp_bucket_cap_mb)"
    if parameter_bytes is None:
        return f"the U-Net {split}"
    count = ddp_graphs(parameter_bytes, bucket_cap_mb)
    return f"the U-Net {split}: about {count} graphs for its {parameter_bytes / MB:,.0f} MB of fp32 gradients"


# Issue 30's third GPU run (docs/gpu-path.md): the whole SD2 U-Net as one graph at 256 px, batch 64, cold
# cache, alone on the machine: 158 s to the end of the first step (about 100 s of that on one core, tracing
# and lowering). Block by block (compile_scope=blocks, the graphs per-block FSDP makes), three compiles side
# by side: about 200 s per resolution. From a warm cache: 15 s.
COLD_COMPILE_SEEN = (
    "a cold compile of SD2's U-Net took 158 s at one shape on an H200 (torch 2.11, 16 cores; about 200 s "
    "block by block), per resolution or bucket, and 15 s from a warm cache"
)
