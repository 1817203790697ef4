"""Stop training on a non-finite loss before a checkpoint of broken weights is written.

No host-device sync per step: each microbatch's loss folds into a device-side flag (`bad |= ~isfinite`),
read once every `log.console_interval` batches and always before a checkpoint is saved. Composer runs
callbacks in list order and appends its CheckpointSaver after the job's callbacks, so this check runs
before the saver in the same BATCH_CHECKPOINT / EPOCH_CHECKPOINT event. Before a save it also checks the
weights that would be written (an inf gradient can break the weights while the loss was still finite).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss (or the weights about to be saved) became NaN or infinite; training stopped."""


def _losses(loss: Any) -> list[torch.Tensor]:
    if isinstance(loss, torch.Tensor):
        return [loss]
    if isinstance(loss, dict):
        return [v for v in loss.values() if isinstance(v, torch.Tensor)]
    if isinstance(loss, list | tuple):
        return [v for v in loss if isinstance(v, torch.Tensor)]
    return []


def weights_finite(model: torch.nn.Module) -> torch.Tensor:
    """A 0-d bool tensor: every floating-point parameter and buffer of `model` is finite (no sync)."""
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point() and t.numel()]
    if not tensors:
        return torch.tensor(True)
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


class NonFiniteGuard(Callback):
    """Raise NonFiniteLossError when a loss since the last check was not finite (see module doc)."""

    def __init__(self, check_interval: str, save_interval: Any):
        self.check_due = create_interval_scheduler(check_interval, include_end_of_training=True)
        # A schedule callable (the CheckpointSaver's own, train/resilience/monitor.py) or an interval string.
        self.save_due = (
            save_interval if callable(save_interval)
            else create_interval_scheduler(save_interval, include_end_of_training=True)
        )  # fmt: skip
        self.bad: torch.Tensor | None = None
        self.last_good_batch = 0

    def after_loss(self, state: State, logger: Logger) -> None:
        for loss in _losses(state.loss):
            flag = ~torch.isfinite(loss.detach()).all()
            self.bad = flag if self.bad is None else self.bad | flag

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        saving = bool(self.save_due(state, Event.BATCH_CHECKPOINT))
        if saving or self.check_due(state, Event.BATCH_CHECKPOINT):
            self.check(state, with_weights=saving)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self.check(state, with_weights=True)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.check(state, with_weights=True)

    def check(self, state: State, with_weights: bool) -> None:
        """One host-device sync (plus one all-reduce, so every rank stops together)."""
        device = next(state.model.parameters()).device
        bad = torch.zeros((), dtype=torch.bool, device=device) if self.bad is None else self.bad.to(device)
        weights_bad = ~weights_finite(state.model).to(device) if with_weights else torch.zeros_like(bad)
        flags = torch.stack([bad, weights_bad]).to(torch.int32)
        dist.all_reduce(flags, reduce_operation="MAX")
        loss_bad, broken_weights = (bool(v) for v in flags.tolist())
        batch = int(state.timestamp.batch)
        if not (loss_bad or broken_weights):
            self.bad, self.last_good_batch = None, batch
            return
        what = "the loss became NaN or infinite" if loss_bad else "the weights became NaN or infinite"
        raise NonFiniteLossError(
            f"training stopped at batch {batch}: {what} after batch {self.last_good_batch} (the last check "
            "that passed); no checkpoint was written after that. Check the data (re-run `make encode`; a "
            "shard changed after encoding fails its hash check), or lower optimizer.lr / set "
            "optimizer.grad_clip_norm, then rerun to resume from the latest checkpoint"
        )
