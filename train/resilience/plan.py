"""The dry-run plan's resilience numbers: interruptions to expect, work lost per interruption, the save's
share of wall time, the lead time a deadline needs and the settings in force. Light (no torch / composer).

Failure rate: Llama 3 (arXiv 2407.21783, section 3.3.4): 419 unexpected interruptions in 54 days on 16,384
H100s, about 78% of them hardware. Per GPU-day that is 419 / (16,384 x 54) = 4.7e-4, so 256 GPUs for 12.8
days expect ~1.6; BLOOM's and OPT's logbooks report more (restarts every few days at 384 and 992 GPUs).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from shared.launch.plan import plural
from train.config import TrainConfig, time_count

INTERRUPTIONS_PER_GPU_DAY = 419 / (16_384 * 54)
# Time from a failure to training again: detection (a crash at once, a hang after hang_timeout_s is not
# counted here), process start with imports (~10 s), model build and checkpoint load (~60 s for SD2-base
# from a parallel filesystem), data loader warm-up. An estimate, stated as one.
RESTART_OVERHEAD_S = 120.0
# The lead a deadline needs beyond the save itself: the step in flight, the stop agreement and the exit.
LEAD_MARGIN_S = 60.0
DEFAULT_LEAD_S = 120.0  # when the save time cannot be estimated (a preset without published sizes)


@dataclass(frozen=True)
class RunShape:
    """What the numbers need about the run; None where the plan cannot tell (then lines say so)."""

    gpus: int
    step_s: float | None  # one optimizer step at the published throughput
    save_s: float | None  # one checkpoint save
    total_steps: int | None


def exit_lead_s(cfg: TrainConfig, save_s: float | None) -> float:
    """How long before a deadline the ranks start their last save: twice the estimated save plus a margin."""
    if cfg.resilience.exit_lead_s is not None:
        return cfg.resilience.exit_lead_s
    return DEFAULT_LEAD_S if save_s is None else math.ceil(2 * save_s + LEAD_MARGIN_S)


def total_steps(cfg: TrainConfig) -> int | None:
    if re.fullmatch(r"\d+ba", cfg.max_duration):
        return time_count(cfg.max_duration)
    if re.fullmatch(r"\d+sp", cfg.max_duration):
        return math.ceil(time_count(cfg.max_duration) / cfg.global_batch_size)
    return None  # epochs / dur: depends on the dataset's size


def save_every_s(cfg: TrainConfig, step_s: float | None) -> float | None:
    """Seconds between saves: the batch interval or the wall-clock one, whichever comes first."""
    options = []
    if step_s is not None and cfg.save_interval.endswith("ba"):
        options.append(time_count(cfg.save_interval) * step_s)
    if cfg.save_interval_minutes is not None:
        options.append(cfg.save_interval_minutes * 60.0)
    return min(options) if options else None


def resilience_lines(cfg: TrainConfig, shape: RunShape, lead_s: float) -> list[str]:
    res = cfg.resilience
    lines = []
    if shape.step_s is not None and shape.total_steps is not None:
        days = shape.step_s * shape.total_steps / 86_400
        expected = INTERRUPTIONS_PER_GPU_DAY * shape.gpus * days
        lines.append(
            f"interruptions: expect {expected:.2f} unexpected over {days:.1f} days on {shape.gpus} GPUs "
            f"(Llama 3's {INTERRUPTIONS_PER_GPU_DAY:.1e} per GPU-day), plus a hang, a time limit or a "
            "preemption per scheduler slot"
        )
    every = save_every_s(cfg, shape.step_s)
    if every is not None:
        lost_h = shape.gpus * (every / 2 + RESTART_OVERHEAD_S) / 3600
        share = f", saving {shape.save_s / (every + shape.save_s):.2%} of wall time" if shape.save_s else ""
        lines.append(
            f"lost per interruption: {lost_h:.1f} GPU-hours on average (half of a {every / 60:.1f}-minute "
            f"save interval + {RESTART_OVERHEAD_S:.0f} s restart, x {plural(shape.gpus, 'GPU')}){share}"
        )
    wall = f", save and exit after {res.max_wall_time}" if res.max_wall_time else ""
    minutes = f" or {cfg.save_interval_minutes:g} min" if cfg.save_interval_minutes else ""
    lines.append(
        f"resilience: save every {cfg.save_interval}{minutes}; up to {res.max_restarts} restarts per launch, "
        f"hang after {res.hang_timeout_s:g} s without a step, collectives time out after "
        f"{res.collective_timeout_s:g} s, Slurm requeues up to {res.max_requeues}; deadlines save "
        f"{lead_s:g} s early{wall}"
    )
    return lines
