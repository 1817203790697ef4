"""`python -m train launch --gpus 256 --launcher slurm --config sd2-base-256 [--dry-run] [key=value ...]`.

The train job's launch description: its config (so a bad override fails before any launch), the batch split
over the ranks, the planner's time/cost line; shared/launch derives the rest and carries it out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Annotated

import typer

from shared import storage
from shared.batching import Batching, BatchingError, derive_batching
from shared.config import ConfigError, load_config
from shared.estimate import estimate_for_plan
from shared.estimate.cluster import (
    DEFAULT_WRITE_GB_PER_S_PER_NODE,
    DTYPE_BYTES,
    GB,
    PRESET_PARAMS,
    PUBLISHED_IMAGES_PER_S_PER_A100,
    SAVE_SHARE_TARGET,
    StateUpdate,
    Strategy,
    checkpoint_cost,
    host_bound_note,
    min_interval_for_share,
    save_share,
    state_update,
    state_update_lines,
    step_comm,
    step_seconds,
    unet_device_seconds,
)
from shared.estimate.gpus import GPU_TABLE
from shared.estimate.memory import ddp_alternative
from shared.estimate.model import PhaseEstimate, dataset_text_store_line
from shared.launch.cli import GpuTypeOpt, OverridesArg, launch_command
from shared.launch.plan import LaunchOptions, LaunchPlan, Topology, plural, program_target, rank_resources
from shared.launch.steps import build_steps
from shared.launch.supervisor import Supervision
from train.config import TrainConfig, time_count
from train.config.memory import memory_plan_line
from train.data.mix import data_cost_factor, plan_lines
from train.eval.cost import plan_line as eval_plan_line
from train.model.compile_plan import compile_plan_line, cuda_graph_refusal
from train.resilience.plan import RunShape, exit_lead_s, resilience_lines, total_steps

DEFAULT_GPU_TYPE = "A100-40GB"  # the planner's reference GPU (jobs/estimate/sd2-base.yaml)
# Host memory per train rank (GiB), an estimate: the rank's process builds the U-Net in fp32 on the host
# (SD2-base: 3.5 GB) and, with full-state-dict checkpoints, rank 0 gathers weights + EMA + AdamW state
# (~14 GB) into host memory to save; with the CUDA runtime that is 24 GiB. Each Streaming data loader
# worker is a Python + torch process with a few prefetched batches: 2 GiB.
# The tiny preset (0.8 M parameters) needs only the process itself: the demo's CPU training rank peaks at
# ~1 GB resident (torch + Composer + Streaming); 4 GiB leaves room for a CUDA context. Presets not listed
# here are planned at SD2-base's size.
TRAIN_BASE_GB = {"sd2-base": 24, "tiny": 4}
TRAIN_GB_PER_WORKER = 2
REFERENCE_PRESET = "sd2-base"  # the preset whose throughput jobs/estimate/sd2-base.yaml holds


def load_train_config(config: str, overrides: Sequence[str]) -> TrainConfig:
    """The full TrainConfig (light: no torch, no composer), so a bad override fails before any launch."""
    return load_config(TrainConfig, config, overrides, kind="train")


def plan_train(
    config: str,
    overrides: Sequence[str] = (),
    options: LaunchOptions | None = None,
    environ: Mapping[str, str] | None = None,
    gpu_type: str = DEFAULT_GPU_TYPE,
    write_gb_per_s: float = DEFAULT_WRITE_GB_PER_S_PER_NODE,
) -> LaunchPlan:
    """The launch of `python -m train fit CONFIG overrides...` on `options.gpus` ranks."""
    options = options or LaunchOptions()
    cfg = load_train_config(config, overrides)
    topology = options.topology()
    program = ("train", "fit", program_target(config), *overrides)
    plan = LaunchPlan("train", config, options, topology, program)
    try:  # fsdp=null decided for this many ranks, as the job decides it (and refused where it would be)
        cfg = cfg.for_world(topology.world_size)
    except ConfigError as err:  # a dry run still prints the rest of the plan, this last
        plan.refuse(str(err))
    # device_microbatch_size=null: what fits `gpu_type` (the job decides it for the GPU it finds)
    memory_gb = None if cfg.device == "cpu" else GPU_TABLE[gpu_type].memory_gb
    cfg = cfg.with_microbatch_for(topology.world_size, memory_gb)
    plan.supervision = supervision_of(cfg, topology, write_gb_per_s)
    plan.max_requeues = cfg.resilience.max_requeues
    check_save_folder(plan, cfg)
    plan.node_local = node_local_lines(cfg, topology, options.shared_save_folder)
    base_gb = TRAIN_BASE_GB.get(cfg.model.preset, TRAIN_BASE_GB[REFERENCE_PRESET])
    plan.resources = rank_resources(options, cfg.data.num_workers, base_gb, TRAIN_GB_PER_WORKER)
    plan.steps = build_steps(plan, os.environ if environ is None else environ)  # checks this machine (local)
    plan.estimate, phase = run_estimate(cfg, topology.world_size, gpu_type)
    step = planned_step(cfg, topology.world_size, phase)
    plan.reference.append(estimate_line(topology.world_size, gpu_type))
    try:
        plan.batching = derive_batching(
            cfg.global_batch_size, topology.world_size, cfg.device_microbatch_size
        )
    except BatchingError as err:  # a dry run still prints the rest of the plan, this last
        plan.refuse(str(err))
    else:
        plan.cluster, notes = cluster_lines(cfg, topology, plan.batching, write_gb_per_s, step, gpu_type)
        plan.notes += notes
        micro = plan.batching.microbatch
        params = PRESET_PARAMS.get(cfg.model.preset, 0)
        update = run_state_update(cfg, topology.world_size, "DDP", params)
        ddp = ddp_alternative(gpu_type, cfg.model.preset, cfg.data.resolution, micro, update)
        rate = phase.images_per_s_per_gpu if phase else None
        if rate and (host := host_bound_note(bool(cfg.fsdp), micro, rate, ddp)):
            plan.notes.append(host)
        device = "cpu" if cfg.device == "cpu" else "gpu"
        if why := cuda_graph_refusal(cfg, device, plan.batching.grad_accum):
            plan.refuse(why)
    plan.memory, warning = memory_plan_line(cfg, topology.world_size, gpu_type)
    plan.notes += [warning] if warning else []
    first_uri = cfg.data.streams[0].uri if cfg.data.streams else cfg.data.uri  # "" until data.uri is given
    text_store = dataset_text_store_line(topology.world_size, gpu_type, first_uri)
    if cfg.model.preset == REFERENCE_PRESET:
        plan.cluster.append(text_store)
    else:  # priced at SD2-base sizes and schedule: a reference for scale, not this run's storage
        plan.reference.append(f"not this run: {text_store}")
    plan.cluster += plan_lines(cfg.data, cfg.shuffle_seed())
    shape = run_shape(cfg, topology, write_gb_per_s, step[0] if step else None)
    plan.cluster += resilience_lines(cfg, shape, exit_lead_s(cfg, shape.save_s))
    params = PRESET_PARAMS.get(cfg.model.preset)
    gradient_bytes = params * DTYPE_BYTES["fp32"] if params else None  # what DDP buckets
    if compile_line := compile_plan_line(cfg, "gpu", topology.world_size, gradient_bytes):  # issue 30
        plan.cluster.append(compile_line)
    eval_line = plan.batching and eval_plan_line(cfg, topology.world_size, plan.batching.per_rank_batch)
    if eval_line:
        plan.cluster.append(eval_line)
    return plan


def supervision_of(cfg: TrainConfig, topology: Topology, write_gb_per_s: float) -> Supervision:
    """The supervisor settings from the config's `resilience` section (shared/launch/supervisor.py)."""
    res = cfg.resilience
    lead = exit_lead_s(cfg, run_shape(cfg, topology, write_gb_per_s, None).save_s)
    elastic = topology.nodes > 1  # torchrun's elastic agent restarts every node's ranks together
    return Supervision(res.max_restarts, res.hang_timeout_s, res.max_wall_time_s(), lead, elastic=elastic)


def check_save_folder(plan: LaunchPlan, cfg: TrainConfig) -> None:
    """Several nodes and a local save_folder: each node would write its own ranks' part of every checkpoint
    into its own disk (a sharded checkpoint split over the nodes), and a resume elsewhere finds a fraction."""
    nodes = plan.topology.nodes
    if nodes == 1 or storage.is_s3(cfg.save_folder) or plan.options.shared_save_folder:
        return
    plan.refuse(
        f"save_folder={cfg.save_folder} is a local path and this run has {nodes} nodes: each node "
        "would keep its own part of every checkpoint on its own disk. Use save_folder=s3://bucket/runs/x, "
        "or a path every node mounts and say so with --shared-save-folder (make: "
        "LAUNCH_ARGS=--shared-save-folder)"
    )


def node_local_lines(cfg: TrainConfig, topology: Topology, shared_save: bool) -> list[str]:
    """What each node keeps on its own disk (the dry-run plan's `node-local` rows)."""
    cache = (
        cfg.data.cache_dir or "<tmp>/sd-pretrain-streaming-<uid>/.../run-<hash(save_folder)> (data.cache_dir)"
    )
    where = "on each node" if topology.nodes > 1 else "on the node"
    save = cfg.save_folder
    run_dir = cfg.log.local_dir or (
        "<tmp>/sd-pretrain-runs-<uid>/<run> (log.local_dir)" if storage.is_s3(save) else save
    )
    lines = [
        f"Streaming cache {where}: {cache}; shards are fetched into it by each node's ranks",
        f"control folder {where}: <tmp>/sd-control-* (heartbeats, stop and exit records of that node's "
        "supervisor; removed when it exits)",
        "lease: one, by global rank 0, next to the data (<data.uri>/_leases/), not per node",
        f"logs, metrics and sample grids {where}: {run_dir} (rank 0's are uploaded to an s3:// save_folder); "
        "the sample renderer's local rank 0 loads the text tower and VAE first, the node's other ranks then "
        "read its copy (a marker per host and launch in <that folder>/samples)",
    ]
    if not storage.is_s3(save) and topology.nodes == 1:
        lines.append(f"checkpoints: {save} (this node's disk)")
    elif not storage.is_s3(save) and shared_save:
        lines.append(f"checkpoints: {save} (one folder every node mounts: --shared-save-folder)")
    return lines


def planned_step(cfg: TrainConfig, world: int, phase: PhaseEstimate | None) -> tuple[float, str] | None:
    """Seconds an optimizer step takes, and the rate they come from: the rate this run's time and cost were
    priced at (so every line of the plan describes the same run), else the published A100 one."""
    if phase is not None:
        per_gpu = phase.cluster_images_per_s / world
        basis = f"the estimate's {per_gpu:.1f} img/s per GPU on {plural(world, 'GPU')}"
        return cfg.global_batch_size / phase.cluster_images_per_s, basis
    rate = PUBLISHED_IMAGES_PER_S_PER_A100.get(cfg.data.resolution)
    if rate is None or cfg.model.preset not in PRESET_PARAMS:
        return None
    return step_seconds(cfg.global_batch_size, rate, world), f"the published {rate} img/s per A100"


def run_shape(cfg: TrainConfig, topology: Topology, write_gb_per_s: float, step_s: float | None) -> RunShape:
    """Step (planned_step) and save times (None for presets without published sizes)."""
    params = PRESET_PARAMS.get(cfg.model.preset)
    world = topology.world_size
    save_s = None
    if params:
        ckpt = checkpoint_cost(params, world, topology.nodes, write_gb_per_s)
        sharded = cfg.resolved_checkpoint_format(world) == "sharded"
        save_s = ckpt.sharded_save_s if sharded else ckpt.full_save_s
    return RunShape(world, step_s, save_s, total_steps(cfg))


def accumulation_note(cfg: TrainConfig, batching: Batching) -> str:
    """What several microbatches per step cost under FSDP (docs/gpu-tests.md, "Gradient accumulation")."""
    steps = plural(batching.grad_accum, "accumulation step")
    bigger = f"raise device_microbatch_size to {batching.per_rank_batch} if it fits in GPU memory"
    if not cfg.fsdp_no_sync:
        return (
            f"{steps} under FSDP: every microbatch gathers the parameters and reduce-scatters the gradients "
            f"again (fsdp_no_sync=false); set fsdp_no_sync=true, or {bigger}"
        )
    return (
        f"{steps} under FSDP: gradients accumulate unsharded (fsdp_no_sync: 2 bytes a parameter per rank, "
        f"summed in bf16) and are reduced once a step; {bigger}"
    )


def cluster_lines(
    cfg: TrainConfig,
    topology: Topology,
    batching: Batching,
    write_gb_per_s: float,
    step: tuple[float, str] | None,
    gpu_type: str,
) -> tuple[list[str], list[str]]:
    """Per-step communication, state update, checkpoint size and save time (formulas:
    shared/estimate/cluster.py)."""
    notes = []
    strategy = cfg.strategy(topology.world_size)
    if strategy != "DDP" and batching.grad_accum > 1:
        notes.append(accumulation_note(cfg, batching))
    params = PRESET_PARAMS.get(cfg.model.preset)
    if params is None:
        return [], notes
    # Under amp_bf16 / amp_fp16 FSDP gathers the params in that dtype (mixed precision param_dtype).
    param_bytes = DTYPE_BYTES["fp32"] if cfg.precision == "fp32" else DTYPE_BYTES["bf16"]
    # DDP all-reduces its fp32 params' gradients in ddp_reduce_dtype; FSDP reduces in fsdp_reduce_dtype.
    reduce_dtype = cfg.ddp_reduce_dtype if strategy == "DDP" else cfg.fsdp_reduce_dtype
    reduce_bytes = DTYPE_BYTES[reduce_dtype]
    comm = step_comm(
        params,
        topology.world_size,
        batching.grad_accum,
        strategy,
        param_bytes,
        reduce_bytes,
        cfg.fsdp_no_sync,
    )
    ckpt = checkpoint_cost(params, topology.world_size, topology.nodes, write_gb_per_s)
    param_dtype = "fp32" if param_bytes == DTYPE_BYTES["fp32"] else "bf16"
    terms = [
        (comm.all_gathers, "all-gather", f"{param_dtype} params", comm.all_gather_bytes),
        (comm.reduce_scatters, "reduce-scatter", f"{reduce_dtype} grads", comm.reduce_scatter_bytes),
        (comm.all_reduces, "all-reduce", f"{reduce_dtype} grads", comm.all_reduce_bytes),
    ]
    parts = [f"{plural(n, kind)} of {what} {size / GB:.3f} GB" for n, kind, what, size in terms if n]
    microbatches = plural(batching.grad_accum, "microbatch", "microbatches")
    lines = [
        f"communication per rank per step ({strategy}, {microbatches}): "
        f"{' + '.join(parts)} = {comm.total_bytes / GB:.3f} GB",
        f"checkpoint {ckpt.total_bytes / GB:.2f} GB (fp32 weights + EMA + AdamW); sharded "
        f"{ckpt.per_rank_bytes / 1e6:.1f} MB per rank; save at {write_gb_per_s:g} GB/s per node: "
        "full (rank 0) "
        f"{ckpt.full_save_s:.1f} s, sharded {ckpt.sharded_save_s:.2f} s",
    ]
    update = run_state_update(cfg, topology.world_size, strategy, params)
    res, images = cfg.data.resolution, batching.per_rank_batch
    device_s = unet_device_seconds(cfg.model.preset, res, images, gpu_type)
    what = f"{plural(images, 'image')} at {res} px"
    update_line, update_note = state_update_lines(
        update, strategy, gpu_type, cfg.optimizer.fused, device_s, what
    )
    lines.append(update_line)
    notes += [update_note] if update_note else []
    if step is None or not cfg.save_interval.endswith("ba"):
        return lines, notes
    step_s, basis = step
    interval = time_count(cfg.save_interval)
    full, sharded = (
        save_share(ckpt.full_save_s, interval, step_s),
        save_share(ckpt.sharded_save_s, interval, step_s),
    )
    lines.append(
        f"saving every {cfg.save_interval} at {basis} "
        f"(step {step_s * 1000:.1f} ms): "
        f"full {full:.2%}, sharded {sharded:.2%} of wall time"
    )
    if full > SAVE_SHARE_TARGET and cfg.resolved_checkpoint_format(topology.world_size) == "full":
        # Composer shards checkpoints only under its FSDP (TrainConfig refuses sharded without it)
        switch = "fsdp=true" if strategy == "DDP" else "checkpoint_format=sharded"
        notes.append(
            f"full-state-dict saves every {cfg.save_interval} cost {full:.1%} of wall time: keep it under "
            f"{SAVE_SHARE_TARGET:.0%} with sharded checkpoints ({sharded:.2%}: {switch}) or "
            f"save_interval={min_interval_for_share(ckpt.full_save_s, step_s)}ba"
        )
    return lines, notes


def run_state_update(cfg: TrainConfig, world: int, strategy: Strategy, params: int) -> StateUpdate:
    """Each rank's clipping + AdamW + EMA update per step, as this config runs it."""
    ema = time_count(cfg.ema.update_interval) if cfg.ema.enabled else None
    return state_update(params, world, strategy, cfg.optimizer.grad_clip_norm is not None, ema)


def run_samples(cfg: TrainConfig) -> int | None:
    """Training samples the run sees: max_duration in batches or samples; None for epochs (dataset-sized)."""
    if cfg.max_duration.endswith("ba"):
        return time_count(cfg.max_duration) * cfg.global_batch_size
    if cfg.max_duration.endswith("sp"):
        return time_count(cfg.max_duration)
    return None


def run_estimate(cfg: TrainConfig, gpus: int, gpu_type: str) -> tuple[str, PhaseEstimate | None]:
    """Time and cost of the config being launched, where the planner has a throughput for its model, and
    the phase it priced (None where it priced none)."""
    samples = run_samples(cfg)
    what = f"this run: {cfg.max_duration}" + (f" = {samples:,} samples" if samples else "")
    what += f" of the {cfg.model.preset} preset at {cfg.data.resolution} px"
    if cfg.model.preset != REFERENCE_PRESET:
        why = f"the planner's throughput is {REFERENCE_PRESET}'s (make bench measures)"
        return f"{what}; no time or cost: {why}", None
    if samples is None:
        return f"{what}; no time or cost: give max_duration in batches (e.g. 550000ba) to price it", None
    # a bucket mix is priced as the square samples of the same FLOPs (pixels; train/data/mix.py)
    factor = data_cost_factor(cfg.data, cfg.shuffle_seed())
    priced = round(samples * factor)
    if priced != samples:
        what += f" (bucket mix: compute x{factor:.3f}, priced as {priced:,} square samples)"
    phase = f"schedule=[{{name: this-run, resolution: {cfg.data.resolution}, samples: {priced}}}]"
    try:
        est = estimate_for_plan(gpus, gpu_type, overrides=[phase, "encode.samples=0"])
    except (ConfigError, OSError) as err:
        return f"{what}; unavailable ({err})", None
    line = (
        f"{what}: {gpus} x {gpu_type}: {wall_time(est.train_days)}, {est.train_gpu_hours:,.1f} GPU-hours, "
        f"${est.train_dollars:,.0f} ({est.pricing_mode} ${est.price_per_gpu_hour:.2f}/GPU-hour; throughput "
        "of jobs/estimate/sd2-base.yaml)"
    )
    return line, est.phases[0]


def wall_time(days: float) -> str:
    """`3.21 days`, `5.4 hours` or `12 min`: a short run reads in its own unit, not as 0.00 days."""
    if days >= 1:
        return f"{days:.2f} days"
    return f"{days * 24:.1f} hours" if days * 24 >= 1 else f"{days * 24 * 60:.0f} min"


def estimate_line(gpus: int, gpu_type: str) -> str:
    """The reference: the planner's summary of the full published SD2 schedule (shared/estimate), which is
    not what a shorter or smaller config costs."""
    try:
        summary = estimate_for_plan(gpus, gpu_type).summary()
    except (ConfigError, OSError) as err:
        return f"unavailable ({err})"
    return f"not this run: the full SD2-base schedule (jobs/estimate/sd2-base.yaml) on {summary}"


@launch_command
def launch(
    overrides: OverridesArg = None,
    config: Annotated[str, typer.Option("--config", help="a name in jobs/train/ or a YAML path")] = "tiny",
    gpu_type: GpuTypeOpt = DEFAULT_GPU_TYPE,
    write_gb_per_s: Annotated[
        float,
        typer.Option("--write-gb-per-s", help="checkpoint write bandwidth per node (GB/s) for the plan"),
    ] = DEFAULT_WRITE_GB_PER_S_PER_NODE,
    shared_save_folder: Annotated[
        bool,
        typer.Option(
            "--shared-save-folder", help="several nodes: the local save_folder is one path every node mounts"
        ),
    ] = False,
    *,
    options: LaunchOptions,
) -> LaunchPlan:
    """Train on GPUS ranks: torchrun here, an sbatch job on Slurm, or an Indexed Job on Kubernetes."""
    del shared_save_folder  # a LaunchOptions field: launch_command put it into `options`
    return plan_train(config, overrides or [], options, gpu_type=gpu_type, write_gb_per_s=write_gb_per_s)


launch_command = launch  # the name train/cli.py registers
