"""Whether a run compiles its U-Net, and the dry-run plan's line about it; torch-free, so the launch plan
(train/launch.py) can say it without importing torch."""

from __future__ import annotations

from train.config import TrainConfig


def use_compile(cfg: TrainConfig, device: str) -> bool:
    """`compile` as asked, or (null) on GPU only: it pays there, and costs minutes of C++ compiling on CPU."""
    if cfg.compile is None:
        return device == "gpu"
    return cfg.compile


def compile_plan_line(cfg: TrainConfig, device: str = "gpu") -> str:
    """The dry-run plan's line for a compiled run ("" when the run stays eager): the first step also compiles
    the U-Net's forward and backward, where the kernels are cached, and where to read the measured time."""
    if not use_compile(cfg, device):
        return ""
    graphs = "one graph per FSDP unit (each ResNet / transformer block) plus the glue between them"
    if not cfg.fsdp:
        graphs = "the whole U-Net as one graph"
    cache = cfg.compile_cache_dir or "inductor's default per-node /tmp folder (set compile_cache_dir)"
    return (
        f"compile ({cfg.compile_backend}): the first step also compiles the U-Net's forward and backward, "
        f"{graphs}; its extra time is `make bench BENCH=full`'s anatomy.compiled.compile_s (not measured at "
        f"SD2 shapes on a GPU yet); restarts and other ranks reuse the kernels cached in {cache}"
    )
