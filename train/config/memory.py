"""The run's microbatch against a GPU's memory, said the same way by the dry-run plan (train/launch.py, for
a GPU type) and by a run at its start (train/loop/prepare.py, for the GPU it found): torch-free, from the
activations measured for the shipped GPU recipes (shared/estimate/memory.py)."""

from __future__ import annotations

from shared.estimate.memory import MEASURED_AS, memory_check
from train.config.job import TrainConfig


def memory_plan_line(
    cfg: TrainConfig, world_size: int, gpu_type: str, memory_gb: float | None = None
) -> tuple[str, str]:
    """(the plan's memory row, a warning or ""): device_microbatch_size against `gpu_type`'s memory (or
    `memory_gb`, the GPU a run found), from the activations measured for the shipped GPU recipes
    (shared/estimate/memory.py)."""
    check = memory_check(
        gpu_type,
        cfg.model.preset,
        cfg.data.resolution,
        cfg.device_microbatch_size,
        world_size,
        cfg.strategy(world_size),
        cfg.global_batch_size,
        memory_gb,
    )
    if isinstance(check, str):
        return check, ""
    differ = [
        what
        for what, differs in (
            (f"precision={cfg.precision}", cfg.precision not in ("auto", "amp_bf16")),
            ("model.low_precision_norms=false", not cfg.model.low_precision_norms),
            ("model.gradient_checkpointing=true", cfg.model.gradient_checkpointing),
        )
        if differs
    ]
    line = check.line()
    if differ:
        line += f" (activations measured as {MEASURED_AS}; this run has {', '.join(differ)})"
    if check.fits:
        return line, ""
    return line, (
        f"WARNING: device_microbatch_size={cfg.device_microbatch_size} on {gpu_type} ({check.used_gb:.1f} GB "
        f"of {check.memory_gb:g} GB, at most {check.fit.max_images} per GPU) {check.advice()}"
    )
