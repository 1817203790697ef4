"""What a held-out eval costs, without torch: the callback logs it at start, the dry-run plan prints it."""

from __future__ import annotations

import math

from train.config import EvalConfig, TrainConfig, time_count


def num_batches(cfg: EvalConfig, world: int, batch: int) -> int:
    """Forwards per rank: the busiest rank's pair count over the batch size (the same on every rank)."""
    per_rank = math.ceil(cfg.num_samples / world) * len(cfg.timesteps)
    return math.ceil(per_rank / batch)


def forwards_per_eval(cfg: EvalConfig, world: int, batch: int) -> int:
    """U-Net forwards one eval costs each rank, for both weight sets (EMA and training)."""
    return 2 * num_batches(cfg, world, batch)


def overhead(cfg: EvalConfig, world: int, batch: int, per_rank_batch: int, interval_batches: int) -> float:
    """An eval's U-Net work over the training work between two evals, per rank: eval forwards count as 1,
    a training sample as 3 (forward + backward). Defaults (2048 samples x 5 timesteps every 5000 batches):
    ~0.07% at any rank count (both grow with the global batch)."""
    eval_samples = forwards_per_eval(cfg, world, batch) * batch
    return eval_samples / (3 * per_rank_batch * interval_batches)


def plan_line(cfg: TrainConfig, world: int, per_rank_batch: int) -> str | None:
    """The dry-run plan's eval line (None while eval.uri is unset): forwards per eval and the share of the
    training compute, the step budget the eval takes."""
    if not cfg.eval.uri:
        return None
    batch = cfg.eval_batch_size()
    forwards = forwards_per_eval(cfg.eval, world, batch)
    line = (
        f"held-out eval: {cfg.eval.num_samples} samples x {len(cfg.eval.timesteps)} timesteps every "
        f"{cfg.eval.interval}, {forwards} forwards of {batch} per rank (EMA and training weights)"
    )
    if cfg.eval.interval.endswith("ba"):
        share = overhead(cfg.eval, world, batch, per_rank_batch, time_count(cfg.eval.interval))
        line += f", {100 * share:.2f}% of the training compute"
    return line
