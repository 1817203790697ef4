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
        if cfg.compile_scope == "blocks":
            graphs = "each ResNet / transformer block as its own graph, one per shape (the glue eager)"
    cache = cfg.compile_cache_dir or "inductor's default per-node /tmp folder (set compile_cache_dir)"
    return (
        f"compile ({cfg.compile_backend}): the first step also compiles the U-Net's forward and backward, "
        f"{graphs}; {COLD_COMPILE_SEEN}; `make bench BENCH=full` prints its first_step_s per resolution; "
        f"restarts and other ranks reuse the kernels cached in {cache}"
    )


# Issue 30's second GPU run: the whole SD2 U-Net as one graph at 256 px, cold cache. About 100 s passed on
# one core (tracing, lowering) before the first Triton kernel was built; 1,046 by 205 s, load <= 5 of 16.
COLD_COMPILE_SEEN = (
    "a cold compile of SD2's U-Net at one shape took over 205 s on an H200 (torch 2.11, 16 cores; not "
    "finished then), per resolution or bucket"
)
