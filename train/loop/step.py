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
  this rank's own clock;
- the microbatch sample count (an all-reduce + `.item()` at the start of `_train_microbatches`): taken
  from this rank's batch shape, the same on every rank for the same reason.
Under FSDP with several microbatches a step, all but the last run inside FSDP's `no_sync` (Composer applies
it to DDP only), so the parameters are gathered and the gradients reduced once a step, not once a microbatch
(`accumulation_sync`; config `fsdp_no_sync`; docs/gpu-tests.md has the counts and the trade-off).
Evaluation and prediction keep Composer's own loop. `make bench` (scale section) and
tests/train/test_step_syncs.py count 0 read-backs per step.

The rest is host time per step that does not grow with the cluster but delays the next step's kernels
(tiny CPU bench: the share of a batch outside forward, backward and optimizer step): events are dispatched
only to callbacks that handle them (train/loop/events.py); `_train_batch` skips three things Composer does on
every batch for automatic microbatching or nothing: a walk over every module (`state.fsdp_enabled`,
~0.16 ms here), `torch.cuda.memory_stats()`, and logging the constant microbatch size (logged once); and
`_train_microbatch` skips Composer's deep copy of every microbatch (~0.3 ms here, a device copy on a GPU),
which it keeps only to evaluate train metrics. Automatic microbatching, fp16 gradient scaling and train
metrics run Composer's own methods.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from composer import Trainer
from composer.core import Callback, Event, State, TrainerMode, get_precision_context
from composer.core.engine import Engine
from composer.distributed import ddp_sync_context
from composer.loggers import Logger
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from shared.contract import LATENT_MEAN
from train.config import time_count
from train.data import packing
from train.loop.events import make_lean

LOSS_METRIC = "loss/train/total"  # Composer's name; metrics.jsonl calls it "loss"


# Composer's Engine registers `atexit(Engine._close, state, logger)` for every trainer and keeps it after
# close(), and torch's distributed-checkpoint state-dict helper caches (model, name) pairs for good
# (`_get_fqns`, functools.cache): a closed trainer's State (model, optimizer, EMA, dataloaders and their
# Streaming shared memory) lived until the process ended. A process that builds trainers one after another
# (`make bench`'s trainer and as_recipe sections, the suite's workers) held every earlier one: 14
# descriptors and a /dev/shm prefix per dataset, the weights and optimizer state per model (on a GPU, device
# memory the next section lacks).
_OPEN_TRAINERS: weakref.WeakSet[Trainer] = weakref.WeakSet()


def let_go_of(closed: Trainer) -> None:
    """Drop what keeps a closed trainer alive outside it. atexit removes by function alone (every engine's
    registration at once), so the trainers still open are registered again; the torch cache only
    recomputes what it dropped."""
    _OPEN_TRAINERS.discard(closed)
    atexit.unregister(Engine._close)
    for trainer in list(_OPEN_TRAINERS):
        atexit.register(Engine._close, trainer.state, trainer.logger)
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    cache_clear = getattr(getattr(dcp_state_dict, "_get_fqns", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


class LeanTrainer(Trainer):
    """Composer's Trainer without its per-step read-backs, bookkeeping collectives and host work for
    features this job does not use (see module doc)."""

    def __init__(self, *args: Any, fsdp_no_sync: bool = True, **kwargs: Any) -> None:
        self.fsdp_no_sync = fsdp_no_sync  # config `fsdp_no_sync`: see accumulation_sync
        super().__init__(*args, **kwargs)
        make_lean(self.engine)
        _OPEN_TRAINERS.add(self)

    def close(self) -> None:
        super().close()
        let_go_of(self)

    def _train_batch(self, use_grad_scaling: bool) -> Any:
        if self.state.auto_microbatching or use_grad_scaling:
            super()._train_batch(use_grad_scaling)
        else:
            self._train_fixed_microbatches()
        # None is Composer's "no loss to log" (its gradient-scaling failure path): no all-reduce, no
        # `.cpu().item()`. StepLossLog logs the loss instead.
        return None

    def _train_fixed_microbatches(self) -> None:
        """Composer's `_train_batch` where the microbatch size is fixed and no GradScaler steps: split, run
        the microbatches, step (see the module doc for what it leaves out)."""
        state, spec = self.state, self._train_data_spec
        assert spec is not None and state.device_train_microbatch_size is not None, "set in __init__/fit()"
        if state.train_metrics is not None:
            for metric in state.train_metrics.values():
                metric.reset()
        total_loss_dict = {"loss/train/total": state.device.tensor_to_device(torch.zeros(size=(1,)))}
        microbatches = spec.split_batch(state.batch, state.device_train_microbatch_size)
        self._train_microbatches(microbatches, total_loss_dict)
        for optimizer in state.optimizers:
            optimizer.step()
        if not self.first_train_batch_complete:
            size = state.device_train_microbatch_size
            self.logger.log_metrics({"trainer/device_train_microbatch_size": size})
        self.first_train_batch_complete = True

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

    def _train_microbatch(
        self, use_grad_scaling: bool, current_batch_size: int | float, is_final_microbatch: bool
    ) -> dict[str, torch.Tensor]:
        """Composer's microbatch (forward, loss, backward and their events) without its deep copy of the
        batch, which it keeps only to evaluate train metrics after the backward; this job has none."""
        state, spec = self.state, self._train_data_spec
        assert spec is not None, "set in __init__() or fit()"
        if (
            use_grad_scaling
            or state.auto_microbatching
            or state.train_metrics
            or self.accumulate_train_batch_on_tokens
            or state.device.dist_backend == "xla"
        ):
            return super()._train_microbatch(use_grad_scaling, current_batch_size, is_final_microbatch)
        share = spec.get_num_samples_in_batch(state.batch) / current_batch_size
        with self._gradient_sync(is_final_microbatch):
            self.engine.run_event(Event.BEFORE_FORWARD)
            with get_precision_context(state.precision, state.precision_config):
                state.outputs = state.model(state.batch)
            self.engine.run_event(Event.AFTER_FORWARD)
            self.engine.run_event(Event.BEFORE_LOSS)
            with get_precision_context(state.precision, state.precision_config):
                state.loss = self._original_model.loss(state.outputs, state.batch)
            self.engine.run_event(Event.AFTER_LOSS)
            self.engine.run_event(Event.BEFORE_BACKWARD)
            assert isinstance(state.loss, torch.Tensor), "DiffusionModel.loss returns one tensor"
            # Composer's scaling: the sample-weighted mean over the step's microbatches
            loss = state.loss.mean() * share
            loss.backward(create_graph=self._backwards_create_graph)
            self.engine.run_event(Event.AFTER_BACKWARD)
        return {"total": loss.detach()}

    def _gradient_sync(self, is_final_microbatch: bool) -> contextlib.AbstractContextManager[Any]:
        """No gradient sync but on the last microbatch: DDP's as Composer does, and FSDP's (`fsdp_no_sync`),
        which Composer leaves out (its FSDP path gathers and reduces every microbatch)."""
        if isinstance(self.state.model, DistributedDataParallel):
            return ddp_sync_context(self.state, is_final_microbatch, self._ddp_sync_strategy)
        if not self.fsdp_no_sync:
            return contextlib.nullcontext()
        return accumulation_sync(self.state.model, is_final_microbatch)

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


def fsdp_roots(model: torch.nn.Module) -> list[FullyShardedDataParallel]:
    """The FSDP roots of a model: Composer 0.32 wraps each child of the ComposerModel that has parameters
    as its own root (the model itself, when a caller wrapped it whole)."""
    if isinstance(model, FullyShardedDataParallel):
        return [model]
    return [child for child in model.children() if isinstance(child, FullyShardedDataParallel)]


def accumulation_sync(model: torch.nn.Module, is_final_microbatch: bool) -> contextlib.ExitStack:
    """FSDP's `no_sync` on every root for all but the step's last microbatch; a no-op without FSDP.

    Inside it each FSDP unit keeps its unsharded gradient and adds the next microbatch's to it; the last
    microbatch reduce-scatters the sum once. Under SHARD_GRAD_OP the gathered parameters also stay alive
    from one microbatch to the next (FSDP frees them in the backward only when it syncs), so a step of N
    microbatches all-gathers and reduce-scatters once per unit instead of N times. Under FULL_SHARD the
    parameters are still freed after each forward and backward and gathered again: only the
    reduce-scatters go. Both keep one unsharded gradient per rank (2 bytes a parameter in bf16: 1.7 GB for
    SD2-base's U-Net), accumulated in the gathered params' dtype; `make bench` counts the collectives
    (train/bench/scale.py `count_accumulation`)."""
    stack = contextlib.ExitStack()
    if not is_final_microbatch:
        for root in fsdp_roots(model):
            if any(p.requires_grad for p in root.parameters()):
                stack.enter_context(root.no_sync())
    return stack


def microbatch_size(batch: Any) -> int:
    """Samples in a microbatch, from its shape (a host-side number: no sync); 1 for one without latents."""
    if packing.is_packed(batch) or (isinstance(batch, dict) and LATENT_MEAN in batch):
        return packing.num_samples(batch)
    return 1


class StepLossLog(Callback):
    """Each optimizer step's loss (the sample-weighted mean over its microbatches, averaged over ranks, as
    Composer's `loss/train/total`), kept on the device and logged in bursts (see module doc)."""

    def __init__(self, log_interval: str, save_interval: Any):
        self.log_every = time_count(log_interval)
        # A schedule callable (the CheckpointSaver's own, train/resilience/monitor.py) or an interval string.
        self.save_due = (
            save_interval if callable(save_interval)
            else create_interval_scheduler(save_interval, include_end_of_training=True)
        )  # fmt: skip
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
