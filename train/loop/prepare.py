"""Everything a run decides before any model is built, and can refuse cheaply: device, precision,
batching, the dataset manifest and its contract, the pinned version, where training starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from shared.batching import Batching, derive_batching
from shared.config import ConfigError, config_to_dict
from shared.contract import ContractError, Expectation, check_compatible
from shared.manifest import DatasetManifest
from shared.presets import get_preset
from shared.runtime.device import check_node_sees_gpu, nodes_in_launch, resolve_device_kind
from shared.runtime.device import resolve_precision as resolve_job_precision
from shared.storage import private_temp_dir
from train.checkpoints.files import find_latest_checkpoint, resolve_checkpoint
from train.config import TrainConfig, time_count
from train.config.memory import memory_plan_line  # the dry-run plan says the same line
from train.data.buckets import check_bucket_epochs, stream_entries
from train.data.loader import DataError, PinnedData, pin_version, read_dataset_manifest
from train.data.mix import (
    PinnedStream,
    check_same_encoders,
    epoch_counts,
    pin_streams,
    read_stream_manifests,
)
from train.data.recorded import pin_recorded_versions, recorded_version_gone
from train.model.compile_plan import check_cuda_graphs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartPoint:
    """Where training starts: a checkpoint to resume or initialise from, or nothing (fresh)."""

    load_path: str | None = None
    weights_only: bool = False
    resuming: bool = False


@dataclass
class RunContext:
    cfg: TrainConfig
    run_name: str
    device: str  # "cpu" or "gpu"
    precision: str
    batching: Batching
    manifest: DatasetManifest
    pinned: PinnedData
    local_dir: str  # log, metrics, samples and the resolved config go here
    start: StartPoint
    # data.streams: every stream, pinned (manifest / pinned above are the first's, which the model is
    # built from); []: one dataset (data.uri).
    streams: list[PinnedStream] = field(default_factory=list)


# ---------------------------------------------------------------------------------------- preparing
def resolve_device(cfg: TrainConfig) -> str:
    device = resolve_device_kind(cfg.device)
    # A GPU job (fsdp true, or null as the SD2 recipes have it) on a host whose GPUs are not seen.
    if device == "cpu" and cfg.fsdp is not False and cfg.device != "cpu":
        raise ConfigError(
            f"fsdp={'null' if cfg.fsdp is None else 'true'} needs GPUs and none is visible; pass fsdp=false "
            "for a CPU run, or device=cpu to run FSDP on CPU ranks over gloo (docs/gpu-path.md)"
        )
    check_node_sees_gpu(cfg.device, device, nodes_in_launch())
    if device == "cpu" and cfg.fsdp:  # asked for: the sharded path on CPU ranks (train/loop/cpu_fsdp.py)
        log.info("fsdp=true on CPU: FSDP over gloo, as the tests run it; GPU runs shard the same way")
    return device


def resolve_precision(cfg: TrainConfig, device: str) -> str:
    """auto -> amp_bf16 on GPU, fp32 on CPU (shared/runtime/device.py resolves it for every job)."""
    return resolve_job_precision(cfg.precision, device)


def world_size() -> int:
    from composer.utils import dist

    return dist.get_world_size()


def expected_shapes(cfg: TrainConfig) -> Expectation:
    preset = get_preset(cfg.model.preset)
    res = cfg.data.resolution
    multiple = 2 ** (len(preset.unet["block_out_channels"]) - 1)  # the U-Net's 2x downsamplings
    return Expectation(res, preset.latent_shape(res), preset.text_shape(), cfg.model.scale_factor, multiple)


def check_data_contract(cfg: TrainConfig, manifest: DatasetManifest) -> None:
    """Refuse data the model cannot use before step 1 (shapes, resolution, scale factor, contract version)."""
    check_compatible(manifest, expected_shapes(cfg))


def prepare_data(cfg: TrainConfig) -> tuple[DatasetManifest, PinnedData, list[PinnedStream]]:
    """Read, check and pin the run's data: data.uri, or every stream of data.streams (each checked against
    the model's contract, then against the first stream's encoders)."""
    if not cfg.data.is_mix():
        manifest = read_dataset_manifest(cfg.data)
        check_data_contract(cfg, manifest)
        return manifest, pin_version(cfg.data, manifest, cfg.save_folder), []
    manifests = read_stream_manifests(cfg.data)
    for (name, manifest), stream in zip(manifests, cfg.data.streams, strict=True):
        try:
            check_data_contract(cfg, manifest)
        except ContractError as err:
            raise ContractError(f"data.streams: stream {name} ({stream.uri}): {err}") from None
    check_same_encoders(manifests)
    streams = pin_streams(cfg.data, manifests, cfg.save_folder)
    return manifests[0][1], streams[0].pinned, streams


def prepare_data_of(
    cfg: TrainConfig, run_name: str, start: StartPoint
) -> tuple[DatasetManifest, PinnedData, list[PinnedStream], TrainConfig]:
    """prepare_data, a resume on the versions it trained on (train/data/recorded.py); the config with
    them."""
    if not start.resuming:
        return (*prepare_data(cfg), cfg)
    recorded = pin_recorded_versions(cfg, [local_run_dir(cfg, run_name), cfg.save_folder])
    try:
        return (*prepare_data(recorded), recorded)
    except FileNotFoundError as err:
        if recorded is cfg:
            raise
        raise DataError(recorded_version_gone(cfg.data, err)) from None


def stream_epoch_counts(cfg: TrainConfig, streams: list[PinnedStream]) -> list[int]:
    """Samples each stream gives per epoch (Streaming's weighting arithmetic, train/data/mix.py)."""
    weights = [s.cfg.weight() for s in streams]
    sizes = [s.pinned.num_samples for s in streams]
    return epoch_counts(weights, sizes, cfg.data.epoch_size, cfg.shuffle_seed())


def local_run_dir(cfg: TrainConfig, run_name: str) -> str:
    if cfg.log.local_dir:
        return cfg.log.local_dir
    if not cfg.save_is_remote():
        return cfg.save_folder
    # Per user and private: a computable shared /tmp path could be planted by another user.
    return str(private_temp_dir("sd-pretrain-runs", "log.local_dir") / run_name)


class RunFinishedError(ValueError):
    """Autoresume found a checkpoint already at max_duration: nothing to train; the message says what next."""


def check_not_finished(cfg: TrainConfig, latest: str) -> None:
    """Stop before any model is built when the latest checkpoint already reached max_duration (Composer would
    fail much later with advice a user cannot apply: `reset_time=True in Trainer.fit()`)."""
    # Composer names checkpoints ep{epoch}-ba{batch}-rank{rank}.pt (sharded: the folder ep{e}-ba{b}).
    done = re.search(r"-ba(\d+)", latest.rstrip("/").rsplit("/", 1)[-1])
    if not done or not cfg.max_duration.endswith("ba"):
        return  # counted in epochs or samples: Composer's own check applies
    batches, limit = int(done.group(1)), time_count(cfg.max_duration)
    if batches >= limit:
        raise RunFinishedError(finished_message(cfg.save_folder, batches, cfg.max_duration))


def finished_message(save_folder: str, batches: int, max_duration: str) -> str:
    longer = f"max_duration={2 * batches}ba"
    return (
        f"the run in {save_folder} already finished: its latest checkpoint is at {batches}ba and "
        f"max_duration is {max_duration}.\n  train it longer: add {longer} (make train ARGS='{longer}'); "
        "start a new run: add save_folder=<a new folder>"
    )


def resolve_start(cfg: TrainConfig) -> StartPoint:
    """Autoresume from save_folder's latest checkpoint; else load_path (maybe weights-only); else fresh."""
    if cfg.autoresume:
        latest = find_latest_checkpoint(cfg.save_folder)
        if latest:
            check_not_finished(cfg, latest)
            log.info("autoresume: continuing from %s", latest)
            return StartPoint(latest, weights_only=False, resuming=True)
    if cfg.load_path:
        path = resolve_checkpoint(cfg.load_path)
        log.info("starting from %s (%s)", path, "weights only" if cfg.load_weights_only else "full state")
        return StartPoint(path, weights_only=cfg.load_weights_only, resuming=False)
    return StartPoint()


def resolve_fsdp(cfg: TrainConfig, world: int) -> TrainConfig:
    """`cfg` with fsdp decided for `world` ranks; a null fsdp says what it became (TrainConfig.fsdp)."""
    resolved = cfg.for_world(world)
    if cfg.fsdp is None:
        why = "more than one rank" if resolved.fsdp else "one rank has nothing to shard"
        log.info("fsdp: null -> %s on %d rank%s (%s)", str(resolved.fsdp).lower(), world,
                 "s" if world > 1 else "", why)  # fmt: skip
    return resolved


def log_memory_fit(cfg: TrainConfig, world: int, gpu_name: str, memory_gb: float) -> None:
    """The microbatch against the GPU this run found, as the dry-run plan says it for a GPU type: a warning
    where it does not fit, or leaves most of the GPU unused while a larger microbatch divides the rank's
    batch (the recipes' 8 per GPU on one GPU: 8 ran at 27 img/s, 128 at 583 on an H200;
    docs/performance.md); else one info line (a larger batch per GPU would change the recipe). Nothing where
    no activation bytes were measured for the preset and resolution."""
    line, warning = memory_plan_line(cfg, world, gpu_name, memory_gb)
    if line.startswith("no measured activation bytes"):
        return
    larger = "most of it unused: set device_microbatch_size" in line
    log.log(logging.WARNING if warning or larger else logging.INFO, "memory: %s", warning or line)


def gpu_memory() -> tuple[str, float]:
    """This rank's GPU: its name and memory in GB (1e9 bytes)."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, props.total_memory / 1e9


def log_gpu_memory_fit(cfg: TrainConfig, device: str, world: int) -> None:
    """log_memory_fit for this node's GPU, once a node (local rank 0); nothing on CPU."""
    if device != "gpu" or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    log_memory_fit(cfg, world, *gpu_memory())


def resolve_microbatch(cfg: TrainConfig, device: str, world: int) -> TrainConfig:
    """`cfg` with a null device_microbatch_size decided for this run's GPU (TrainConfig.with_microbatch_for),
    said in one line."""
    if cfg.device_microbatch_size is not None:
        return cfg
    name, memory_gb = gpu_memory() if device == "gpu" else ("", None)
    resolved = cfg.with_microbatch_for(world, memory_gb)
    found = f"fits {name}'s {memory_gb:.0f} GB" if memory_gb else "no GPU memory to fit: the rank's batch"
    log.info("device_microbatch_size: null -> %d (%s)", resolved.device_microbatch_size, found)
    return resolved


# Config keys that may differ between nodes: paths on each node's own disks.
NODE_LOCAL_KEYS = frozenset({"data.cache_dir", "log.local_dir", "compile_cache_dir"})


def resolved_config(ctx: RunContext) -> TrainConfig:
    """The config with derived choices filled in: rerunning it reproduces this run (same data version)."""
    if ctx.streams:
        pinned = [dataclasses.replace(s.cfg, name=s.name, version=s.pinned.version) for s in ctx.streams]
        data = dataclasses.replace(ctx.cfg.data, streams=pinned)
    else:
        data = dataclasses.replace(ctx.cfg.data, version=ctx.pinned.version)
    return dataclasses.replace(ctx.cfg, run_name=ctx.run_name, data=data)


def rank_decisions(ctx: RunContext) -> dict[str, Any]:
    """What this rank decided from its own GPU, the GPU, and the config it runs, with the versions it
    pinned: gathered from every rank once they have joined (check_ranks_agree). Pinned versions, not
    `data.version` as each rank resolved it: a resume pins what the run's train_config.yaml records, and
    rank 0 may have rewritten that file (same versions, now pinned) before another rank read it, which
    then held "v1" where rank 0 held null (a 2-rank resume refused on CI)."""
    gpu = gpu_memory()[0] if ctx.device == "gpu" else "no GPU"
    flat = {
        key: json.dumps(value) for key, value in flat_config(config_to_dict(resolved_config(ctx))).items()
    }
    config = {key: value for key, value in flat.items() if key not in NODE_LOCAL_KEYS}
    return {"gpu": gpu, "device_microbatch_size": str(ctx.cfg.device_microbatch_size), "config": config}


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optimizer": {"lr": 1e-4}} -> {"optimizer.lr": 1e-4} (the override keys)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flat_config(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def rank_spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][-1] + 1:
            spans[-1].append(rank)
        else:
            spans.append([rank])
    return ", ".join(str(s[0]) if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans)


def check_ranks_agree(decisions: list[dict[str, Any]]) -> None:
    """Refuse, on every rank alike, a run whose ranks sized their microbatch from different GPUs
    (device_microbatch_size=null on GPUs of unequal memory): with unequal microbatches the ranks would
    accumulate a different number of times a step, and under FSDP each microbatch's collectives would stop
    pairing up (a hang, then a restart into the same hang). Then one whose ranks run different configs
    (check_same_config)."""
    by_value: dict[str, list[int]] = {}
    for rank, decided in enumerate(decisions):
        by_value.setdefault(decided["device_microbatch_size"], []).append(rank)
    if len(by_value) < 2:
        check_same_config([decided.get("config", {}) for decided in decisions])
        return
    gpus = {value: sorted({decisions[r]["gpu"] for r in ranks}) for value, ranks in by_value.items()}
    found = "; ".join(
        f"{value} on rank{'s' if len(ranks) > 1 else ''} {rank_spans(ranks)} ({', '.join(gpus[value])})"
        for value, ranks in sorted(by_value.items(), key=lambda item: int(item[0]))
    )
    smallest = min(int(value) for value in by_value)
    raise ConfigError(
        "device_microbatch_size=null sized the microbatch from each rank's GPU and the ranks differ: "
        f"{found}. Set device_microbatch_size={smallest} (the smallest) so every rank runs the same "
        "microbatches, or run on GPUs of one type"
    )


def check_same_config(configs: list[dict[str, str]]) -> None:
    """Refuse a world whose ranks run different configs: the same command typed on each machine of a local
    multi-node launch, one with another override (optimizer.lr=0.01), formed one world and trained each
    rank on its own learning rate; both nodes exited 0."""
    keys = sorted({key for config in configs for key in config})
    differing = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, config in enumerate(configs):
            by_value.setdefault(config.get(key, "(unset)"), []).append(rank)
        if len(by_value) > 1:
            sides = "; ".join(f"{value} on ranks {rank_spans(ranks)}" for value, ranks in by_value.items())
            differing.append(f"{key}: {sides}")
    if differing:
        shown = " | ".join(differing[:4]) + (
            f" | and {len(differing) - 4} more" if len(differing) > 4 else ""
        )
        raise ConfigError(
            f"the ranks of this run were started with different configs ({shown}): start every node with "
            "the same config and overrides"
        )


def prepare_run(cfg: TrainConfig) -> RunContext:
    device = resolve_device(cfg)
    precision = resolve_precision(cfg, device)
    world = world_size()
    cfg = resolve_microbatch(resolve_fsdp(cfg, world), device, world)
    batching = derive_batching(cfg.global_batch_size, world, cfg.device_microbatch_size)
    check_cuda_graphs(cfg, device, batching.grad_accum)
    log_gpu_memory_fit(cfg, device, world)
    run_name = cfg.resolved_run_name()
    start = resolve_start(cfg)
    manifest, pinned, streams, cfg = prepare_data_of(cfg, run_name, start)
    entries = stream_entries(pinned, streams)  # refused here, before any model is built:
    check_bucket_epochs(entries, batching.global_batch, cfg.data.epoch_size, cfg.shuffle_seed())
    ctx = RunContext(
        cfg=cfg,
        run_name=run_name,
        device=device,
        precision=precision,
        batching=batching,
        manifest=manifest,
        pinned=pinned,
        local_dir=local_run_dir(cfg, run_name),
        start=start,
        streams=streams,
    )
    log_run(ctx)
    return ctx


def log_run(ctx: RunContext) -> None:
    b, data = ctx.batching, ctx.pinned
    log.info("run %s on %s in %s", ctx.run_name, ctx.device, ctx.precision)
    log.info(
        "global batch %d = %d ranks x %d (microbatch %d x %d accumulation)",
        b.global_batch, b.world_size, b.per_rank_batch, b.microbatch, b.grad_accum,
    )  # fmt: skip
    if not ctx.streams:
        log.info(
            "data %s version %s: %d samples at %d px",
            data.root,
            data.version,
            data.num_samples,
            data.resolution,
        )
        return
    counts = stream_epoch_counts(ctx.cfg, ctx.streams)
    log.info("data: a mix of %d streams at %d px, %d samples per epoch (batching %s)",
             len(ctx.streams), data.resolution, sum(counts), ctx.cfg.data.batching_method)  # fmt: skip
    for stream, count in zip(ctx.streams, counts, strict=True):
        p = stream.pinned
        weight = stream.cfg.weight() or "its size"
        log.info("  stream %s: %s version %s, %d samples, %d per epoch (%s)",
                 stream.name, p.root, p.version, p.num_samples, count, weight)  # fmt: skip
