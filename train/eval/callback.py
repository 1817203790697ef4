"""HeldOutEval: the held-out loss every `eval.interval` (and at the end of training), for the EMA and the
training weights, logged as `eval/ema/loss`, `eval/training/loss` and `eval/<weights>/loss_t<T>`.

Runs at BATCH_CHECKPOINT, after the CheckpointSaver's EMA swap decided which weights the model holds, so a
checkpoint saved at this step holds exactly the weights evaluated here (`train eval` reproduces the number).
Every rank evaluates its share of the samples (an FSDP forward is collective); the sums are all-reduced once.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback, Event, State
from composer.core.precision import get_precision_context
from composer.loggers import Logger
from composer.utils import dist
from composer.utils.misc import create_interval_scheduler

from shared.encoders import EMBEDDINGS
from shared.manifest import DatasetManifest
from shared.runtime.background import BackgroundJob
from train.config import EvalConfig
from train.data.loader import PinnedData
from train.ema.algorithm import find_ema
from train.eval.cost import num_batches
from train.eval.data import EvalRows, rows_for_rank
from train.eval.heldout import heldout_sums, loss_metrics, rank_pairs
from train.export.samples import use_ema_weights
from train.model.diffusion import DenoiseInput, Objective

log = logging.getLogger(__name__)

METRICS_FILENAME = "metrics.jsonl"  # train/loop/callbacks.py writes it into the run's local folder


class use_training_weights:
    """The training weights in the model for the duration (swapped back in when the EMA is active)."""

    def __init__(self, state: State):
        self.state = state
        self.ema = find_ema(state.algorithms)
        self.swapped = False

    def __enter__(self) -> None:
        if self.ema is not None and self.ema.ema_model is not None and self.ema.ema_weights_active:
            self.ema.ema_model.swap_params(self.state.model)
            self.swapped = True

    def __exit__(self, *exc: object) -> None:
        if self.swapped and self.ema is not None and self.ema.ema_model is not None:
            self.ema.ema_model.swap_params(self.state.model)


def has_ema(state: State) -> bool:
    ema = find_ema(state.algorithms)
    return ema is not None and ema.ema_model is not None and bool(ema.ema_started)


class HeldOutEval(Callback):
    def __init__(
        self, cfg: EvalConfig, pinned: PinnedData, objective: Objective, batch_size: int, local_dir: str = ""
    ):
        self.cfg = cfg
        self.local_dir = local_dir  # where metrics.jsonl is and the loss plot goes ("": no plot)
        self.pinned = pinned
        self.objective = objective
        self.batch_size = batch_size
        self.due = create_interval_scheduler(cfg.interval, include_end_of_training=True)
        self.rows: EvalRows | None = None
        self.last_evaluated = -1  # the last batch of training is both an interval hit and the end
        self.plotting = BackgroundJob("drawing the loss plot")

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._maybe_eval(state, logger, Event.BATCH_CHECKPOINT)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._maybe_eval(state, logger, Event.EPOCH_CHECKPOINT)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.plotting.finish()  # loggers run first: metrics.jsonl is complete
        self.plot()
        self.plotting.finish()

    def plot(self) -> None:
        """Redraw the loss plot in the background (rank 0): the other ranks went on to the next step's
        collective while rank 0 read the whole file and drew it (seconds at 1M steps); skipped while the
        last one still draws."""
        if self.local_dir and dist.get_global_rank() == 0 and not self.plotting.busy():
            from train.eval.plot import LOSS_PLOT, plot_losses

            folder = Path(self.local_dir)
            args = (folder / METRICS_FILENAME, folder / LOSS_PLOT, "training and held-out loss")
            self.plotting.start(plot_losses, *args)

    def _maybe_eval(self, state: State, logger: Logger, event: Event) -> None:
        batch = int(state.timestamp.batch)
        if batch != self.last_evaluated and self.due(state, event):
            self.last_evaluated = batch
            self.evaluate(state, logger)

    def evaluate(self, state: State, logger: Logger) -> dict[str, float]:
        start = time.perf_counter()
        world, rank = dist.get_world_size(), dist.get_global_rank()
        if self.rows is None:
            self.rows = rows_for_rank(self.pinned, self.cfg.num_samples, rank, world)
        batches = rank_pairs(
            self.rows, self.cfg.timesteps, self.batch_size, num_batches(self.cfg, world, self.batch_size)
        )
        device = next(state.model.parameters()).device

        def denoise(x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
            return state.model(DenoiseInput(x, t, text))

        metrics: dict[str, float] = {}
        weight_sets = [("ema", use_ema_weights), ("training", use_training_weights)]
        for name, swap in weight_sets if has_ema(state) else weight_sets[1:]:
            with swap(state), get_precision_context(state.precision):
                was_training = state.model.training
                state.model.eval()
                try:
                    sums = heldout_sums(denoise, self.objective, self.rows, self.cfg, batches, device)
                finally:
                    state.model.train(was_training)
            metrics |= loss_metrics(all_reduce_sum(sums), self.cfg.timesteps, name)
        seconds = time.perf_counter() - start
        logger.log_metrics({**metrics, "eval/seconds": seconds}, step=int(state.timestamp.batch))
        if dist.get_global_rank() == 0:  # every rank holds the all-reduced numbers: one line a run
            log.info("%s", console_line(int(state.timestamp.batch), metrics, seconds, 2 * len(batches)))
        self.plot()
        return metrics


def all_reduce_sum(sums: torch.Tensor) -> torch.Tensor:
    if dist.get_world_size() == 1:
        return sums
    # gloo and NCCL both reduce float64; NCCL needs the tensor on the GPU.
    device = "cuda" if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl" else "cpu"
    reduced = sums.to(device)
    dist.all_reduce(reduced, reduce_operation="SUM")
    return reduced.cpu()


def console_line(batch: int, metrics: dict[str, Any], seconds: float, forwards: int) -> str:
    parts = [f"eval at batch {batch}:"]
    for weights in ("ema", "training"):
        if f"eval/{weights}/loss" in metrics:
            parts.append(f"{weights} loss {metrics[f'eval/{weights}/loss']:.5f}")
    parts.append(f"({forwards} forwards per rank, {seconds:.1f} s)")
    return " ".join(parts)


def log_cost(cfg: Any) -> None:
    """What the eval costs, said once at start (the plan's step budget includes it)."""
    from shared.batching import derive_batching
    from train.eval.cost import plan_line

    world = dist.get_world_size()
    per_rank = derive_batching(cfg.global_batch_size, world, cfg.device_microbatch_size).per_rank_batch
    log.info("%s", plan_line(cfg, world, per_rank))


def build_heldout_eval(
    cfg: Any, objective: Objective, trained_on: DatasetManifest, local_dir: str = ""
) -> HeldOutEval:
    """The callback for a TrainConfig with eval.uri set (its dataset pinned and checked now, before step
    1, against `trained_on`, the training data's manifest)."""
    from train.data.mix import encoder_facts
    from train.eval.data import pin_eval_data

    trained_with = encoder_facts(trained_on.identity, float(trained_on.scale_factor))
    pinned = pin_eval_data(cfg.eval, cfg.model.preset, cfg.data.resolution, cfg.data.cache_dir, trained_with)
    if pinned.manifest.text_store != EMBEDDINGS and objective.online_text is None:
        from shared.config import ConfigError

        raise ConfigError(
            f"the eval dataset {cfg.eval.uri} stores token ids (text.store={pinned.manifest.text_store}) but "
            "the training data stores embeddings, so this run has no text tower to embed them; encode the "
            "held-out set with text.store=embeddings"
        )
    log_cost(cfg)
    return HeldOutEval(cfg.eval, pinned, objective, cfg.eval_batch_size(), local_dir)
