"""What the train job hands Composer besides the model, optimizer and data: its callbacks (in the order they
must run: before Composer's CheckpointSaver, which Composer appends after them), the dataset leases, the
run record every checkpoint carries, and its loggers (train/loop/trainer.py builds the Trainer from them)."""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from shared.config import config_to_dict
from shared.presets import get_preset
from train.config import time_count
from train.data.buckets import sample_buckets
from train.data.loader import RUN_CACHE_PREFIX
from train.data.mix import mix_record
from train.loop.compiled import CompiledGraphsLog
from train.loop.prepare import RunContext
from train.model.compile_plan import use_compile
from train.model.diffusion import DiffusionModel

METRICS_FILENAME = "metrics.jsonl"
SAMPLES_DIRNAME = "samples"


def run_record(ctx: RunContext, model: DiffusionModel) -> dict[str, Any]:
    """What every checkpoint remembers about data, model recipe and encoders (see RunRecord)."""
    manifest = ctx.manifest
    return {
        "run_name": ctx.run_name,
        # epoch_size decides the sample order of one dataset too (Streaming over- or under-samples to it)
        "dataset": mix_record(ctx.cfg.data, ctx.streams)
        if ctx.streams
        else ctx.pinned.record() | {"epoch_size": ctx.cfg.data.epoch_size},
        "preset": ctx.cfg.model.preset,
        # JSON round trip: plain dicts/lists only, so the record never needs custom classes to unpickle.
        "unet_config": json.loads(json.dumps(dict(model.unet.config), default=list)),
        "model": config_to_dict(ctx.cfg.model),
        "scale_factor": float(manifest.scale_factor),
        "encoders": dict(manifest.fingerprints.get("encoders", {})),
        "encoder_config": dict(manifest.config.get("encoder", {})),  # as encode resolved it (kept as is)
        "encoder": manifest.identity.record(),  # what export and samples read (shared/encoders.py)
        "eval": config_to_dict(ctx.cfg.eval),  # `train eval` evaluates a checkpoint as the run did
    }


def build_callbacks(
    ctx: RunContext, model: DiffusionModel, leases: list[Any], saves: Any = None
) -> list[Any]:
    """`leases`: the dataset leases the run already holds (dataset_leases). `saves`: the CheckpointSaver's
    schedule (train/resilience/monitor.py), so the guard and the loss log run before every save, the extra
    ones on a signal or the wall clock too; None: save_interval."""
    from composer.callbacks import LRMonitor, RuntimeEstimator, SpeedMonitor

    from train.checkpoints.record import RunRecord
    from train.checkpoints.retention import CheckpointRetention, save_folder_keep
    from train.data.lease import DatasetLease
    from train.export.samples import SampleRenderer
    from train.loop.guards import NonFiniteGuard
    from train.loop.metrics import ArtifactMirror
    from train.loop.step import StepLossLog

    cfg = ctx.cfg
    wait = cfg.resilience.close_wait_s()  # what each best-effort S3 task gets at close
    callbacks: list[Any] = [
        # Before Composer's CheckpointSaver (appended after these): NaN weights are never saved, and every
        # step's loss is in metrics.jsonl before the checkpoint covering it is published.
        NonFiniteGuard(cfg.log.console_interval, saves or cfg.save_interval),
        StepLossLog(cfg.log.console_interval, saves or cfg.save_interval),
        RunRecord(run_record(ctx, model), allow_dataset_change=cfg.data.allow_dataset_change),
        *leases,
        SpeedMonitor(window_size=cfg.log.speed_window),
        LRMonitor(),
        RuntimeEstimator(),
    ]
    if use_compile(cfg, ctx.device):
        callbacks.append(CompiledGraphsLog())
    if ctx.device == "gpu":
        from train.loop.memory import IntervalMemoryMonitor

        callbacks.append(IntervalMemoryMonitor(time_count(cfg.log.console_interval)))
    if cfg.samples.enabled:
        preset = get_preset(cfg.model.preset)
        renderer = SampleRenderer(
            cfg.samples,
            cfg.model,
            ctx.manifest.identity,
            model.objective.empty_caption,
            preset.latent_shape(cfg.data.resolution),
            ctx.manifest.scale_factor,
            os.path.join(ctx.local_dir, SAMPLES_DIRNAME),
            sample_buckets([s.pinned for s in ctx.streams] or [ctx.pinned]),
        )
        renderer.preload()  # text tower, tokenizer and VAE now, not at the first render (samples.py)
        callbacks.append(renderer)
    if cfg.eval.uri:  # held-out loss (train/eval/): before the CheckpointSaver, like the samples
        from train.eval.callback import build_heldout_eval

        heldout = build_heldout_eval(cfg, model.objective, ctx.manifest, ctx.local_dir)
        # Its rows are read at the first eval, hours in: gc must keep the version pinned now until then.
        pinned = heldout.pinned
        callbacks += [
            heldout,
            DatasetLease(pinned.root, pinned.version, ctx.run_name, close_wait_s=wait).hold_now(),
        ]
    callbacks.append(RunCacheRelease([s.pinned.local for s in ctx.streams] or [ctx.pinned.local]))
    saving = saves or cfg.save_interval  # what the CheckpointSaver saves on: stops and the clock too
    if cfg.save_is_remote():
        callbacks.append(ArtifactMirror(ctx.local_dir, cfg.save_folder, saving, (METRICS_FILENAME,), wait))
    if save_folder_keep(cfg) > 0:
        callbacks.append(CheckpointRetention(cfg.save_folder, save_folder_keep(cfg), saving, wait))
    return callbacks


class RunCacheRelease(Callback):
    """A finished run removes its own Streaming cache folders (the default root's `run-<hash>` folders,
    train/data/loader.py cache_dir_for) after it closed: each run of a host's data has its own copy of the
    shards, up to data.cache_limit, which nothing else removes. A stopped or crashed run keeps them for
    its resume (FIT_END never came)."""

    def __init__(self, folders: list[str]):
        self.folders = [f for f in folders if os.path.basename(f.rstrip("/")).startswith(RUN_CACHE_PREFIX)]
        self.finished = False

    def fit_end(self, state: State, logger: Logger) -> None:
        self.finished = True

    def post_close(self) -> None:
        if self.finished and dist.get_local_rank() == 0:  # the node's ranks share the folder
            for folder in self.folders:
                shutil.rmtree(folder, ignore_errors=True)


def dataset_leases(ctx: RunContext) -> list[Any]:
    """One lease per dataset the run trains on, so `encode gc` keeps every pinned version (hold_now: rank 0
    writes them at once)."""
    from train.data.lease import DatasetLease

    wait = {"close_wait_s": ctx.cfg.resilience.close_wait_s()}
    if not ctx.streams:
        return [DatasetLease(ctx.cfg.data.uri, ctx.manifest.version, ctx.run_name, **wait)]
    return [DatasetLease(s.pinned.root, s.pinned.version, ctx.run_name, **wait) for s in ctx.streams]


def stream_callbacks(ctx: RunContext, dataloader: Any, labels: list[Any], saves: Any = None) -> list[Any]:
    """Sample counts per dataset of a data.streams mix and per bucket of bucketed data
    (train/data/stream_counts.py); `labels`: one per Streaming stream (train/data/buckets.py)."""
    from train.data.stream_counts import StreamSampleCounts

    if not labels:
        return []
    cfg = ctx.cfg  # `saves`: the CheckpointSaver's schedule, so a save on a stop holds its step's counts
    return [StreamSampleCounts(labels, dataloader, cfg.log.console_interval, cfg.save_interval, saves)]


def build_loggers(ctx: RunContext) -> list[Any]:
    from train.loop.metrics import IntervalFileLogger, MetricsJSONL

    cfg = ctx.cfg
    stamp = time.strftime("%Y%m%d-%H%M%S")
    every = time_count(cfg.log.console_interval)  # the console's cadence; metrics.jsonl has every step
    loggers: list[Any] = [
        # One log per start: a resumed run keeps the crashed attempt's log next to its own.
        IntervalFileLogger(os.path.join(ctx.local_dir, "logs", f"train-{stamp}-rank{{rank}}.log"), every),
        MetricsJSONL(os.path.join(ctx.local_dir, METRICS_FILENAME)),
    ]
    if cfg.log.tensorboard:
        from composer.loggers import TensorboardLogger

        loggers.append(TensorboardLogger(log_dir=os.path.join(ctx.local_dir, "tensorboard")))
    if cfg.log.wandb_project:
        from composer.loggers import WandBLogger

        loggers.append(
            WandBLogger(project=cfg.log.wandb_project, entity=cfg.log.wandb_entity, name=ctx.run_name)
        )
    return loggers
