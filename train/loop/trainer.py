"""The train job as small named stages: prepare_run -> build_model -> build_trainer -> fit.

`prepare_run` (train/loop/prepare.py) does everything that can fail cheaply before any model is built:
resolve device and precision, derive batching, read the dataset manifest, check the data contract against
the preset, pin the dataset version into the local cache and decide where training starts (autoresume,
load_path, or fresh).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from shared.config import config_to_dict
from shared.presets import get_preset
from shared.runtime.device import host_cpu_name
from shared.storage.transfers import libraries_retry_like_us
from train.checkpoints.files import (
    CHECKPOINT_FILENAME,
    LATEST_PATTERN,
    poll_uploads_promptly,
)
from train.checkpoints.layouts import conform_optimizer_state
from train.checkpoints.sharded import composer_loads_safely, fsdp_checkpoint_options
from train.config import TrainConfig, time_count
from train.data.buckets import compile_per_bucket, run_streams, sample_buckets
from train.data.loader import build_dataloader
from train.data.mix import mix_record
from train.data.packing import packed_data_spec
from train.data.recorded import CONFIG_FILENAME
from train.loop.compiled import CompiledGraphsLog, composer_ddp
from train.loop.cpu_fsdp import composer_fsdp_on_cpu
from train.loop.prepare import RunContext, check_ranks_agree, prepare_run, rank_decisions
from train.model.assemble import assemble_model, build_unet  # noqa: F401  (build_unet: re-exported for callers)
from train.model.compile_plan import use_compile
from train.model.diffusion import DiffusionModel
from train.model.kernels import fit_recompile_limit, use_gpu_kernel_settings
from train.model.online_text import online_text_for
from train.resilience.signals import restores_signal_handlers

if TYPE_CHECKING:
    from composer import Trainer

log = logging.getLogger(__name__)

METRICS_FILENAME = "metrics.jsonl"
SAMPLES_DIRNAME = "samples"


# ------------------------------------------------------------------------------------------ the model
def build_model(ctx: RunContext) -> DiffusionModel:
    """The model for this run's device (train/model/assemble.py; `make bench` builds it the same way)."""
    empty = torch.from_numpy(ctx.manifest.empty_caption_embedding.astype("float32"))
    online = online_text_for(ctx.manifest, ctx.cfg.model.text_encoder)  # text.store=tokens only
    model = assemble_model(ctx.cfg, ctx.device, ctx.manifest.scale_factor, empty, online)
    use_gpu_kernel_settings(ctx.device, ctx.cfg.attention_backend)  # fixed shapes (train/model/kernels.py)
    compiled = use_compile(ctx.cfg, ctx.device)
    fit_recompile_limit(model.unet, ctx.cfg.fsdp, compiled)
    buckets = {b for p in [s.pinned for s in ctx.streams] or [ctx.pinned] for b in p.buckets}
    compile_per_bucket(len(buckets), compiled)  # one static graph per bucket (train/data/buckets.py)
    return model


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


# ---------------------------------------------------------------------------------------- the trainer
def build_optimizer(cfg: TrainConfig, model: DiffusionModel) -> torch.optim.Optimizer:
    """torch.optim.AdamW: weight decay lr * wd * w, as the published SD2 recipe (not Composer's decoupled);
    fused (optimizer.fused) on CPU or CUDA, where the parameters are when Composer moves the model."""
    opt = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    hyper = {"lr": opt.lr, "betas": opt.betas, "eps": opt.eps, "weight_decay": opt.weight_decay}
    return torch.optim.AdamW(params, **hyper, fused=opt.fused or None)  # None: torch's default


def build_schedulers(cfg: TrainConfig) -> list[Any]:
    from composer.optim import ConstantWithWarmupScheduler, CosineAnnealingWithWarmupScheduler

    if cfg.optimizer.schedule == "cosine":
        return [CosineAnnealingWithWarmupScheduler(t_warmup=cfg.optimizer.warmup, alpha_f=0.0)]
    return [ConstantWithWarmupScheduler(t_warmup=cfg.optimizer.warmup)]


def build_algorithms(ctx: RunContext) -> list[Any]:
    from train.ema.algorithm import build_ema
    from train.loop.clipping import GradNormClipping

    cfg = ctx.cfg
    algorithms: list[Any] = []
    if cfg.optimizer.grad_clip_norm is not None:
        algorithms.append(GradNormClipping(cfg.optimizer.grad_clip_norm))
    if cfg.ema.enabled:
        handoff = ctx.start.weights_only and not ctx.start.resuming
        algorithms.append(
            build_ema(cfg.ema_smoothing_per_update(), cfg.ema.start, cfg.ema.update_interval, handoff=handoff)
        )
    return algorithms


def build_callbacks(ctx: RunContext, model: DiffusionModel, saves: Any = None) -> list[Any]:
    """`saves`: the CheckpointSaver's schedule (train/resilience/monitor.py), so the guard and the loss log
    run before every save, the extra ones on a signal or the wall clock too; None: save_interval."""
    from composer.callbacks import LRMonitor, RuntimeEstimator, SpeedMonitor

    from train.checkpoints.record import RunRecord
    from train.checkpoints.retention import CheckpointRetention
    from train.export.samples import SampleRenderer
    from train.loop.guards import NonFiniteGuard
    from train.loop.metrics import ArtifactMirror
    from train.loop.step import StepLossLog

    cfg = ctx.cfg
    callbacks: list[Any] = [
        # Before Composer's CheckpointSaver (appended after these): NaN weights are never saved, and every
        # step's loss is in metrics.jsonl before the checkpoint covering it is published.
        NonFiniteGuard(cfg.log.console_interval, saves or cfg.save_interval),
        StepLossLog(cfg.log.console_interval, saves or cfg.save_interval),
        RunRecord(run_record(ctx, model), allow_dataset_change=cfg.data.allow_dataset_change),
        *dataset_leases(ctx),
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

        callbacks.append(build_heldout_eval(cfg, model.objective, ctx.manifest, ctx.local_dir))
    saving = saves or cfg.save_interval  # what the CheckpointSaver saves on: stops and the clock too
    if cfg.save_is_remote():
        restore = (METRICS_FILENAME,)
        callbacks.append(ArtifactMirror(ctx.local_dir, cfg.save_folder, saving, restore=restore))
    if save_folder_keep(cfg) > 0:
        callbacks.append(CheckpointRetention(cfg.save_folder, save_folder_keep(cfg), saving))
    return callbacks


def dataset_leases(ctx: RunContext) -> list[Any]:
    """One lease per dataset the run reads, so `encode gc` keeps every pinned version."""
    from train.data.lease import DatasetLease

    if not ctx.streams:
        return [DatasetLease(ctx.cfg.data.uri, ctx.manifest.version, ctx.run_name)]
    return [DatasetLease(s.pinned.root, s.pinned.version, ctx.run_name) for s in ctx.streams]


def stream_callbacks(ctx: RunContext, dataloader: Any, labels: list[Any], saves: Any = None) -> list[Any]:
    """Sample counts per dataset of a data.streams mix and per bucket of bucketed data
    (train/data/stream_counts.py); `labels`: one per Streaming stream (train/data/buckets.py)."""
    from train.data.stream_counts import StreamSampleCounts

    if not labels:
        return []
    cfg = ctx.cfg  # `saves`: the CheckpointSaver's schedule, so a save on a stop holds its step's counts
    return [StreamSampleCounts(labels, dataloader, cfg.log.console_interval, cfg.save_interval, saves)]


def save_folder_keep(cfg: TrainConfig) -> int:
    """How many checkpoints CheckpointRetention keeps in save_folder (<= 0: it does not run)."""
    if cfg.save_is_remote():
        return cfg.save_num_remote_checkpoints_to_keep
    return cfg.save_num_checkpoints_to_keep


def composer_keep(cfg: TrainConfig) -> int:
    """Composer's own pruning: of its local copies of an s3:// run; off (-1) for a local save folder, where
    CheckpointRetention prunes by listing (Composer's pruning forgets earlier jobs, and its os.remove
    would fail on a file retention already deleted)."""
    if cfg.save_is_remote() or cfg.save_num_checkpoints_to_keep <= 0:
        return cfg.save_num_checkpoints_to_keep
    return -1


def build_loggers(ctx: RunContext) -> list[Any]:
    from composer.loggers import FileLogger

    from train.loop.metrics import MetricsJSONL

    cfg = ctx.cfg
    stamp = time.strftime("%Y%m%d-%H%M%S")
    loggers: list[Any] = [
        # One log per start: a resumed run keeps the crashed attempt's log next to its own.
        FileLogger(
            filename=os.path.join(ctx.local_dir, "logs", f"train-{stamp}-rank{{rank}}.log"), overwrite=True
        ),
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


def parallelism_config(ctx: RunContext) -> dict[str, Any] | None:
    if not ctx.cfg.fsdp:
        return None
    return {
        "fsdp": {
            "sharding_strategy": ctx.cfg.fsdp_sharding_strategy,
            # Composer's "DEFAULT" with the reduce dtype from the config (param/buffer dtype: precision's).
            "mixed_precision": {
                "param_dtype": ctx.precision,
                "reduce_dtype": ctx.cfg.fsdp_reduce_dtype,
                "buffer_dtype": ctx.precision,
            },
            # full (one .pt from rank 0) or sharded (each rank writes its part): config checkpoint_format
            **fsdp_checkpoint_options(ctx.cfg.resolved_checkpoint_format(ctx.batching.world_size)),
            "use_orig_params": True,
        }
    }


def resolved_config(ctx: RunContext) -> TrainConfig:
    """The config with derived choices filled in: rerunning it reproduces this run (same data version)."""
    if ctx.streams:
        pinned = [dataclasses.replace(s.cfg, name=s.name, version=s.pinned.version) for s in ctx.streams]
        data = dataclasses.replace(ctx.cfg.data, streams=pinned)
    else:
        data = dataclasses.replace(ctx.cfg.data, version=ctx.pinned.version)
    return dataclasses.replace(ctx.cfg, run_name=ctx.run_name, data=data)


def write_resolved_config(ctx: RunContext) -> None:
    from train.loop.metrics import write_text_file

    text = yaml.safe_dump(config_to_dict(resolved_config(ctx)), sort_keys=False)
    write_text_file(os.path.join(ctx.local_dir, CONFIG_FILENAME), text)


def composer_names_the_cpu_in_process() -> None:
    """Composer names the CPU in every Trainer's hparams and checkpoint with py-cpuinfo, which runs itself as
    a Python subprocess: ~1 s of CPU on every rank at every start (126 processes, 96 CPU s, in one suite)."""
    from composer.utils import collect_env

    collect_env.get_cpu_model = host_cpu_name


def build_trainer(cfg: TrainConfig) -> Trainer:
    from train.loop.step import LeanTrainer
    from train.resilience.monitor import ResilienceMonitor, StopAfterSave

    libraries_retry_like_us()  # Composer's uploader and Streaming's downloads: our S3 attempts (transfers.py)
    composer_names_the_cpu_in_process()
    ctx = prepare_run(cfg)
    cfg = ctx.cfg  # fsdp decided for this run's ranks
    model = build_model(ctx)
    write_resolved_config(ctx)
    # Join torch.distributed before Streaming starts: otherwise Streaming brings up its own process group
    # and tears it down, and Composer's later init reads stale rendezvous addresses (gloo connectFullMesh
    # fails on every rank > 1 run).
    from composer.utils import dist

    dist.initialize_dist(ctx.device)
    check_ranks_agree(dist.all_gather_object(rank_decisions(ctx)))  # one small gather, before any step
    # A mix and/or a bucketed dataset: several Streaming streams (bucket-homogeneous batches: per_stream).
    streams, labels, method = run_streams(
        cfg.data.batching_method,
        ctx.pinned,
        ctx.streams,
        ctx.batching.global_batch,
        cfg.data.download_timeout,
    )
    dataloader = build_dataloader(
        cfg.data, ctx.pinned, ctx.batching.per_rank_batch, cfg.seed, streams, method
    )
    # Composer loads load_path inside Trainer(): safely (a checkpoint is data), in the format this run writes.
    checkpoint_format = cfg.resolved_checkpoint_format(ctx.batching.world_size)
    # First callback: decides at each step boundary whether to save / stop (train/resilience/monitor.py).
    monitor = ResilienceMonitor(
        cfg.save_interval, cfg.save_interval_minutes, cfg.resilience.collective_timeout_s
    )
    with (
        composer_loads_safely(ctx.start.load_path, checkpoint_format) as load_path,
        composer_fsdp_on_cpu(ctx.device, cfg.fsdp),
        composer_ddp(cfg.ddp_bucket_cap_mb, cfg.ddp_reduce_dtype),
    ):
        trainer = LeanTrainer(
            model=model,
            train_dataloader=packed_data_spec(dataloader),
            max_duration=cfg.max_duration,
            optimizers=build_optimizer(cfg, model),
            schedulers=build_schedulers(cfg),
            step_schedulers_every_batch=True,
            algorithms=build_algorithms(ctx),
            callbacks=[
                monitor,
                *build_callbacks(ctx, model, saves=monitor),
                *stream_callbacks(ctx, dataloader, labels, saves=monitor),
            ],
            loggers=build_loggers(ctx),
            run_name=ctx.run_name,
            progress_bar=False,
            log_to_console=True,
            console_log_interval=cfg.log.console_interval,
            load_path=load_path,
            load_weights_only=ctx.start.weights_only,
            save_folder=cfg.save_folder,
            save_filename=CHECKPOINT_FILENAME,
            save_latest_filename=LATEST_PATTERN,  # rank 0's is LATEST_NAME
            save_interval=monitor,
            save_num_checkpoints_to_keep=composer_keep(cfg),
            # After a crash the dead attempt may have written checkpoints past the one we resume from.
            save_overwrite=cfg.autoresume,
            autoresume=False,  # resolved by resolve_start (Composer's own mishandles s3:// save folders)
            parallelism_config=parallelism_config(ctx),
            device=ctx.device,
            precision=ctx.precision,
            device_train_microbatch_size=ctx.batching.microbatch,
            seed=cfg.seed,
            compile_config=None,  # cfg.compile compiles the U-Net alone (train/model/assemble.py)
            fsdp_no_sync=cfg.fsdp_no_sync,  # accumulation without per-microbatch collectives (step.py)
        )
    poll_uploads_promptly(trainer._checkpoint_saver)  # `latest` within a second of an upload
    # After the saver: progress.json and a stop name the checkpoint where it lives (s3:// too).
    trainer.state.callbacks.append(StopAfterSave(monitor, trainer._checkpoint_saver, cfg.save_folder))
    conform_optimizer_state(trainer.state.optimizers)  # AdamW moments loaded in another layout
    return trainer


@restores_signal_handlers  # the caller's SIGTERM / SIGINT / SIGUSR1 again when it returns or raises
def fit(cfg: TrainConfig) -> Trainer:
    """Build and run the trainer; returns it (closed) so callers can inspect state."""
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
    finally:
        close_trainer(trainer)
    return trainer


def close_trainer(trainer: Trainer) -> None:
    """`trainer.close()` (it waits for the checkpoint uploads), then the local staging folder of an s3://
    save folder: Composer stages those checkpoints in a `tempfile.mkdtemp()` folder of its own and never
    removes it (composer/callbacks/checkpoint_saver.py), one per run and rank left in the temp folder; the
    uploader deletes each file once uploaded, so what is left then is empty folders."""
    saver = getattr(trainer, "_checkpoint_saver", None)
    try:
        trainer.close()
    finally:
        if saver is not None and saver.remote_uploader is not None:
            staging = Path(saver.folder).resolve()
            temp = Path(tempfile.gettempdir()).resolve()
            root = next((p for p in staging.parents if p.parent == temp), None)
            if root is not None:  # never anything outside the temp folder
                shutil.rmtree(root, ignore_errors=True)
