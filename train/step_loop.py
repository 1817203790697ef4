"""The training step without per-step host-device syncs or per-step collectives of bookkeeping.

Composer 0.32's loop reads device tensors back to the host four times per step, each after a collective
that only matters for data or optimizers this job does not have. Each read waits for the device to finish
everything queued, so the host cannot queue the next step while this one runs, and on 256 GPUs each
collective is one more latency-bound round per step. `LeanTrainer` drops all four:
- the loss stays on the device: `StepLossLog` keeps each step's loss as a device tensor and logs the
  buffered steps with one all-reduce and one read every `log.console_interval` batches, before every
  checkpoint (ahead of Composer's CheckpointSaver in the same event, so metrics.jsonl holds every step a
  checkpoint covers) and at the end;
- the loss, again, as the return value of an optimizer-step closure (`.item()`): closures serve
  optimizers that re-evaluate the loss (LBFGS); AdamW evaluates it once either way, so the step runs
  without one;
- "has any rank run out of data" (an all-reduce + `.item()` before every batch) and the sample count /
  batch time (`_accumulate_time_across_ranks`: an all-reduce, a broadcast, `.item()`): every rank takes
  the same number of equal per-rank batches (Streaming partitions the epoch evenly; the loader drops the
  last partial batch), so the counts are the per-rank batch times the world size, and the batch time is
  this rank's own clock. Evaluation and prediction keep Composer's own loop.

What Composer still does per step: one all-reduce and `.item()` of the microbatch sample count at the
start of `_train_microbatches` (counted by `make bench`, scale section, and tests/train/test_step_syncs.py).
"""

from __future__ import annotations

import datetime
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from composer import Trainer
from composer.core import Callback, Event, State, TrainerMode
from composer.loggers import Logger
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler

from shared.contract import LATENT_MEAN
from train import packing
from train.config import time_count

ENGINE_DEBUG = "ENGINE_DEBUG"  # Composer's switch for its engine's per-callback debug lines
LOSS_METRIC = "loss/train/total"  # Composer's name; metrics.jsonl calls it "loss"


class LeanTrainer(Trainer):
    """Composer's Trainer without its per-step loss read-back and time all-reduce (see module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not os.environ.get(ENGINE_DEBUG):
            # Composer's engine formats a debug line and reads the environment for every callback of every
            # event (~400 times a batch here) to log it only under ENGINE_DEBUG: ~1 ms of host time per
            # batch on the tiny bench. Set ENGINE_DEBUG before the trainer starts to get those lines.
            self.engine._debug_log = _no_engine_debug_log  # type: ignore[method-assign]

    def _train_batch(self, use_grad_scaling: bool) -> Any:
        super()._train_batch(use_grad_scaling)
        # None is Composer's "no loss to log" (its gradient-scaling failure path): no all-reduce, no
        # `.cpu().item()`. StepLossLog logs the loss instead.
        return None

    def _accumulate_time_across_ranks(
        self, num_samples: int | float, num_tokens: int, batch_time: datetime.timedelta
    ) -> tuple[int, int, datetime.timedelta]:
        world = dist.get_world_size()
        return int(num_samples) * world, int(num_tokens) * world, batch_time

    def _use_closures(self) -> bool:
        return False

    def _train_microbatches(
        self, microbatches: Sequence[Any], total_loss_dict: dict[str, torch.Tensor], ddp_sync: bool = True
    ) -> torch.Tensor:
        """Composer's microbatch loop, with the step's sample count taken from this rank's batch (see the
        module doc) instead of an all-reduce and a read-back."""
        spec = self._train_data_spec
        assert spec is not None and self.state.scaler is not None, "set in __init__() or fit()"
        if (
            self.state.auto_microbatching
            or self.accumulate_train_batch_on_tokens
            or not ddp_sync
            or self._use_grad_scaling(self.state.precision, self.state.scaler)
        ):
            return super()._train_microbatches(microbatches, total_loss_dict, ddp_sync)
        self.engine.run_event(Event.BEFORE_TRAIN_BATCH)
        for optimizer in self.state.optimizers:
            optimizer.zero_grad(set_to_none=True)
        # Composer's count (shapes, on the host); the same on every rank, so no all-reduce
        samples = sum(spec.get_num_samples_in_batch(batch) for batch in microbatches)
        step_batch = self.state.batch  # the microbatch loop overwrites it; Composer restores it after
        for index, microbatch in enumerate(microbatches):
            self.state.batch = spec.microbatch_transforms(self.state.device.batch_to_device(microbatch))
            final = index + 1 == len(microbatches)
            for name, loss in self._train_microbatch(False, samples, final).items():
                key = f"loss/train/{name}"
                if key not in total_loss_dict:
                    total_loss_dict[key] = self.state.device.tensor_to_device(torch.zeros(size=(1,)))
                total_loss_dict[key] += loss
        self.state.batch = step_batch
        self.engine.run_event(Event.AFTER_TRAIN_BATCH)
        return total_loss_dict["loss/train/total"]

    def _iter_dataloader(self, trainer_mode: TrainerMode) -> Iterator[Any]:
        if trainer_mode != TrainerMode.TRAIN:
            yield from super()._iter_dataloader(trainer_mode)
            return
        loader = self.state.dataloader
        assert loader is not None, "the dataloader is set in __init__() or fit()"
        length = self.state.dataloader_len
        batches = iter(loader) if length is None else itertools.islice(loader, int(length))
        while True:
            self.engine.run_event(Event.BEFORE_DATALOADER)
            try:
                batch = next(batches)
            except StopIteration:
                # As Composer: close the dataloader marker that BEFORE_DATALOADER opened.
                self.engine.run_marker_only_event(Event.AFTER_DATALOADER)
                return
            yield batch


def _no_engine_debug_log(event: Event, msg: str) -> None:
    return None


def microbatch_size(batch: Any) -> int:
    """Samples in a microbatch, from its shape (a host-side number: no sync); 1 for one without latents."""
    if packing.is_packed(batch) or (isinstance(batch, dict) and LATENT_MEAN in batch):
        return packing.num_samples(batch)
    return 1


class StepLossLog(Callback):
    """Each optimizer step's loss (the sample-weighted mean over its microbatches, averaged over ranks, as
    Composer's `loss/train/total`), kept on the device and logged in bursts (see module doc)."""

    def __init__(self, log_interval: str, save_interval: str):
        self.log_every = time_count(log_interval)
        self.save_due = create_interval_scheduler(save_interval, include_end_of_training=True)
        self.step_sum: torch.Tensor | None = None  # this step's sum of loss * microbatch size
        self.step_samples = 0
        self.steps: list[int] = []
        self.losses: list[torch.Tensor] = []

    def after_loss(self, state: State, logger: Logger) -> None:
        if not isinstance(state.loss, torch.Tensor):
            return
        size = microbatch_size(state.batch)
        weighted = state.loss.detach().float() * size
        self.step_sum = weighted if self.step_sum is None else self.step_sum + weighted
        self.step_samples += size

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.step_sum is not None:
            self.steps.append(int(state.timestamp.batch))
            self.losses.append(self.step_sum / self.step_samples)
            self.step_sum, self.step_samples = None, 0
        if int(state.timestamp.batch) % self.log_every == 0:
            self.flush(logger)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        if self.save_due(state, Event.BATCH_CHECKPOINT):
            self.flush(logger)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self.flush(logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.flush(logger)

    def flush(self, logger: Logger) -> None:
        """Log every buffered step: one all-reduce and one device-to-host read for all of them."""
        if not self.losses:
            return
        values = torch.stack(self.losses).reshape(-1)
        dist.all_reduce(values, reduce_operation="SUM")
        means = (values / dist.get_world_size()).tolist()
        for step, value in zip(self.steps, means, strict=True):
            logger.log_metrics({LOSS_METRIC: value}, step=step)
        self.steps, self.losses = [], []
