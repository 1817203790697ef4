"""The train job as small named stages: prepare_run -> build_model -> build_trainer -> fit.

`prepare_run` (train/loop/prepare.py) does everything that can fail cheaply before any model is built:
resolve device and precision, derive batching, read the dataset manifest, check the data contract against
the preset, pin the dataset version into the local cache and decide where training starts (autoresume,
load_path, or fresh).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from shared import storage
from shared.config import config_to_dict
from shared.runtime.device import host_cpu_name
from shared.storage.transfers import libraries_retry_like_us
from train.checkpoints.files import (
    CHECKPOINT_FILENAME,
    LATEST_PATTERN,
    poll_uploads_promptly,
)
from train.checkpoints.layouts import conform_optimizer_state
from train.checkpoints.owner import SaveFolderOwner, claim_save_folder
from train.checkpoints.retention import composer_keep
from train.checkpoints.sharded import composer_loads_safely, fsdp_checkpoint_options
from train.checkpoints.uploads import upload_patiently_from
from train.config import TrainConfig
from train.data.buckets import compile_per_bucket, run_streams
from train.data.loader import build_dataloader
from train.data.packing import end_workers, packed_data_spec
from train.data.recorded import CONFIG_FILENAME
from train.loop.callbacks import build_callbacks, build_loggers, dataset_leases, stream_callbacks
from train.loop.compiled import composer_ddp
from train.loop.cpu_fsdp import composer_fsdp_on_cpu
from train.loop.prepare import RunContext, check_ranks_agree, prepare_run, rank_decisions, resolved_config
from train.model.assemble import assemble_model, build_unet  # noqa: F401  (build_unet: re-exported for callers)
from train.model.compile_plan import use_compile
from train.model.diffusion import DiffusionModel
from train.model.kernels import fit_recompile_limit, use_gpu_kernel_settings
from train.model.online_text import online_text_for
from train.resilience.outage import wait_for_s3
from train.resilience.signals import restores_signal_handlers

if TYPE_CHECKING:
    from composer import Trainer

log = logging.getLogger(__name__)


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
    """The Trainer of this run, once S3 answers (train/resilience/outage.py) and the save folder is this
    run's (train/checkpoints/owner.py: released again if the build fails)."""
    libraries_retry_like_us()  # Composer's uploader and Streaming's downloads: our S3 attempts (transfers.py)
    composer_names_the_cpu_in_process()
    wait_for_s3(cfg)  # a start during an S3 outage waits it out before it reads anything
    owner = claim_save_folder(cfg.save_folder, cfg.resolved_run_name(), cfg.resilience.close_wait_s())
    temp_before = temp_entries()
    try:
        return assemble_trainer(cfg, owner)
    except BaseException:
        owner.release_now()
        remove_checkpoint_staging_made_since(cfg, temp_before)
        raise


def temp_entries() -> set[str]:
    return set(os.listdir(tempfile.gettempdir()))


def remove_checkpoint_staging_made_since(cfg: TrainConfig, before: set[str]) -> None:
    """A build that fails inside Composer's Trainer (a checkpoint refused at autoresume) returns no trainer
    for close_trainer, so the staging folder Composer's CheckpointSaver had made for an s3:// save folder
    stayed in the temp folder, one per failed start: the folders made since `before` that hold the save
    folder's key path (how the saver lays out its staging) go."""
    if not cfg.save_is_remote():
        return
    _, key_path = storage.split_s3(cfg.save_folder)
    temp = Path(tempfile.gettempdir())
    for name in temp_entries() - before:
        if key_path and (temp / name / key_path).is_dir():
            shutil.rmtree(temp / name, ignore_errors=True)


def assemble_trainer(cfg: TrainConfig, owner: SaveFolderOwner) -> Trainer:
    from train.loop.step import LeanTrainer
    from train.resilience.monitor import ResilienceMonitor, StopAfterSave

    ctx = prepare_run(cfg)
    leases = [lease.hold_now() for lease in dataset_leases(ctx)]  # pinned: gc keeps them from now on
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
    world = ctx.batching.world_size
    patience = cfg.resilience.shard_patience_s(world)  # a shard a step waits on sits out a short outage
    dataloader = build_dataloader(
        cfg.data, ctx.pinned, ctx.batching.per_rank_batch, cfg.seed, streams, method, patience
    )
    # Composer loads load_path inside Trainer(): safely (a checkpoint is data), in the format this run writes.
    checkpoint_format = cfg.resolved_checkpoint_format(ctx.batching.world_size)
    # First callback: decides at each step boundary whether to save / stop (train/resilience/monitor.py).
    resilience = cfg.resilience
    monitor = ResilienceMonitor(
        cfg.save_interval,
        cfg.save_interval_minutes,
        resilience.collective_timeout_s,
        resilience.closing_s(),
        owner,
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
                owner,
                *build_callbacks(ctx, model, leases, saves=monitor),
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
            save_num_checkpoints_to_keep=composer_keep(cfg),  # the rest is CheckpointRetention's
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
    # s3:// save folders: an upload sits out an outage in the background (train/checkpoints/uploads.py)
    upload_patiently_from(trainer._checkpoint_saver, cfg.resilience.outage_patience_s)
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
    from train.resilience.monitor import ResilienceMonitor

    saver = getattr(trainer, "_checkpoint_saver", None)
    try:
        trainer.close()
    finally:
        state = getattr(trainer, "state", None)
        end_loader_workers(state)
        for callback in state.callbacks if state is not None else []:  # now a rank that stays is hung
            if isinstance(callback, ResilienceMonitor):
                callback.closed.set()
        if saver is not None and saver.remote_uploader is not None:
            staging = Path(saver.folder).resolve()
            temp = Path(tempfile.gettempdir()).resolve()
            root = next((p for p in staging.parents if p.parent == temp), None)
            if root is not None:  # never anything outside the temp folder
                shutil.rmtree(root, ignore_errors=True)


def end_loader_workers(state: Any) -> None:
    """End a closed trainer's loader workers and let go of their iterators (`packing.end_workers`): the
    trainer outlives the run in whoever holds it, which `fit` returns it to (a sweep driver, a notebook, the
    suite: the S3 end-to-end test, reading with 2 workers, held 54 descriptors after it had ended)."""
    if state is None:
        return
    evaluated = [getattr(e.dataloader, "dataloader", None) for e in state.evaluators or []]
    for loader in [state.train_dataloader, *evaluated]:
        end_workers(loader)
