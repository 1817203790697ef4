"""`python -m train launch --gpus 256 --launcher slurm --config sd2-base-256 [--dry-run] [key=value ...]`.

The train job's launch description: its config (so a bad override fails before any launch), the batch split
over the ranks, the planner's time/cost line; shared/launch derives the rest and carries it out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Annotated

import typer

from shared.batching import Batching, derive_batching
from shared.config import ConfigError, load_config
from shared.estimate import estimate_for_plan
from shared.estimate.cluster import (
    DEFAULT_WRITE_GB_PER_S_PER_NODE,
    DTYPE_BYTES,
    GB,
    PRESET_PARAMS,
    PUBLISHED_IMAGES_PER_S_PER_A100,
    SAVE_SHARE_TARGET,
    Strategy,
    checkpoint_cost,
    min_interval_for_share,
    save_share,
    step_comm,
    step_seconds,
)
from shared.estimate.model import dataset_text_store_line
from shared.launch.cli import (
    AccountOpt,
    CpusPerRankOpt,
    DryRunOpt,
    EfaOpt,
    GpusOpt,
    GpuTypeOpt,
    ImageOpt,
    LauncherChoice,
    LauncherOpt,
    MasterAddrOpt,
    MasterPortOpt,
    MemPerRankOpt,
    NameOpt,
    NamespaceOpt,
    NodeRankOpt,
    NodesOpt,
    OverridesArg,
    PartitionOpt,
    PerNodeOpt,
    SbatchOpt,
    SecretOpt,
    TimeOpt,
    launch_options,
    run_cli,
)
from shared.launch.plan import (
    DEFAULT_MASTER_PORT,
    LaunchOptions,
    LaunchPlan,
    Topology,
    plural,
    program_target,
    rank_resources,
)
from shared.launch.steps import build_steps
from train.config import TrainConfig, time_count
from train.data.mix import plan_lines

DEFAULT_GPU_TYPE = "A100-40GB"  # the planner's reference GPU (jobs/estimate/sd2-base.yaml)
# Host memory per train rank (GiB), an estimate: the rank's process builds the U-Net in fp32 on the host
# (SD2-base: 3.5 GB) and, with full-state-dict checkpoints, rank 0 gathers weights + EMA + AdamW state
# (~14 GB) into host memory to save; with the CUDA runtime that is 24 GiB. Each Streaming data loader
# worker is a Python + torch process with a few prefetched batches: 2 GiB.
TRAIN_BASE_GB = 24
TRAIN_GB_PER_WORKER = 2


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
    plan.resources = rank_resources(options, cfg.data.num_workers, TRAIN_BASE_GB, TRAIN_GB_PER_WORKER)
    plan.steps = build_steps(plan, os.environ if environ is None else environ)  # checks this machine (local)
    plan.batching = derive_batching(cfg.global_batch_size, topology.world_size, cfg.device_microbatch_size)
    plan.estimate = estimate_line(topology.world_size, gpu_type)
    plan.cluster, notes = cluster_lines(cfg, topology, plan.batching, write_gb_per_s)
    first_uri = cfg.data.uri or cfg.data.streams[0].uri
    plan.cluster.append(dataset_text_store_line(topology.world_size, gpu_type, first_uri))
    plan.cluster += plan_lines(cfg.data, cfg.seed if cfg.data.shuffle_seed is None else cfg.data.shuffle_seed)
    plan.notes += notes
    return plan


def strategy_of(cfg: TrainConfig) -> Strategy:
    return cfg.fsdp_sharding_strategy if cfg.fsdp else "DDP"


def cluster_lines(
    cfg: TrainConfig, topology: Topology, batching: Batching, write_gb_per_s: float
) -> tuple[list[str], list[str]]:
    """Per-step communication, checkpoint size and save time (formulas: shared/estimate/cluster.py)."""
    notes = []
    strategy = strategy_of(cfg)
    if strategy != "DDP" and batching.grad_accum > 1:
        notes.append(
            f"{plural(batching.grad_accum, 'accumulation step')} under FSDP: every microbatch gathers the "
            "parameters and reduce-scatters the gradients again (Composer's no_sync is DDP-only); raise "
            f"device_microbatch_size to {batching.per_rank_batch} if it fits in GPU memory"
        )
    params = PRESET_PARAMS.get(cfg.model.preset)
    if params is None:
        return [], notes
    # Under amp_bf16 / amp_fp16 FSDP gathers the params in that dtype (mixed precision param_dtype).
    param_bytes = DTYPE_BYTES["fp32"] if cfg.precision == "fp32" else DTYPE_BYTES["bf16"]
    # DDP all-reduces the fp32 gradients of its fp32 params; FSDP reduces in fsdp_reduce_dtype.
    reduce_dtype = "fp32" if strategy == "DDP" else cfg.fsdp_reduce_dtype
    reduce_bytes = DTYPE_BYTES[reduce_dtype]
    comm = step_comm(params, topology.world_size, batching.grad_accum, strategy, param_bytes, reduce_bytes)
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
    rate = PUBLISHED_IMAGES_PER_S_PER_A100.get(cfg.data.resolution)
    if rate is None or not cfg.save_interval.endswith("ba"):
        return lines, notes
    step_s = step_seconds(cfg.global_batch_size, rate, topology.world_size)
    interval = time_count(cfg.save_interval)
    full, sharded = (
        save_share(ckpt.full_save_s, interval, step_s),
        save_share(ckpt.sharded_save_s, interval, step_s),
    )
    lines.append(
        f"saving every {cfg.save_interval} at the published {rate} img/s per A100 "
        f"(step {step_s * 1000:.1f} ms): "
        f"full {full:.2%}, sharded {sharded:.2%} of wall time"
    )
    if full > SAVE_SHARE_TARGET:
        notes.append(
            f"full-state-dict saves every {cfg.save_interval} cost {full:.1%} of wall time: keep it under "
            f"{SAVE_SHARE_TARGET:.0%} with sharded checkpoints ({sharded:.2%}) or "
            f"save_interval={min_interval_for_share(ckpt.full_save_s, step_s)}ba"
        )
    return lines, notes


def estimate_line(gpus: int, gpu_type: str) -> str:
    """The planner's one-line time/cost summary for the SD2 schedule (shared/estimate)."""
    try:
        summary = estimate_for_plan(gpus, gpu_type).summary()
    except (ConfigError, OSError) as err:
        return f"unavailable ({err})"
    return f"full SD2-base schedule (jobs/estimate/sd2-base.yaml): {summary}"


def launch_command(
    overrides: OverridesArg = None,
    config: Annotated[str, typer.Option("--config", help="a name in jobs/train/ or a YAML path")] = "tiny",
    gpus: GpusOpt = 1,
    nodes: NodesOpt = None,
    gpus_per_node: PerNodeOpt = None,
    launcher: LauncherOpt = LauncherChoice.local,
    dry_run: DryRunOpt = False,
    gpu_type: GpuTypeOpt = DEFAULT_GPU_TYPE,
    node_rank: NodeRankOpt = None,
    master_addr: MasterAddrOpt = None,
    master_port: MasterPortOpt = DEFAULT_MASTER_PORT,
    name: NameOpt = None,
    image: ImageOpt = None,
    namespace: NamespaceOpt = None,
    secret: SecretOpt = LaunchOptions.secret,
    partition: PartitionOpt = None,
    account: AccountOpt = None,
    time_limit: TimeOpt = None,
    efa: EfaOpt = False,
    cpus_per_rank: CpusPerRankOpt = None,
    mem_per_rank_gb: MemPerRankOpt = None,
    sbatch_options: SbatchOpt = None,
    write_gb_per_s: Annotated[
        float,
        typer.Option("--write-gb-per-s", help="checkpoint write bandwidth per node (GB/s) for the plan"),
    ] = DEFAULT_WRITE_GB_PER_S_PER_NODE,
) -> None:
    """Train on GPUS ranks: torchrun here, an sbatch job on Slurm, or an Indexed Job on Kubernetes."""
    options = launch_options(locals())
    run_cli(
        lambda: plan_train(
            config, overrides or [], options(), gpu_type=gpu_type, write_gb_per_s=write_gb_per_s
        ),
        dry_run,
    )
