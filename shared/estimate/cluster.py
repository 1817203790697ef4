"""What one optimizer step and one checkpoint cost a data-parallel run: the formulas, written once.

Communication, per rank per optimizer step, for P parameters on W ranks with A microbatches per step
(ring collectives: a rank sends, and receives, (W-1)/W of the full tensor in an all-gather or a
reduce-scatter, twice that in an all-reduce):

    SHARD_GRAD_OP  A x [1 all-gather of the params (param dtype) + 1 reduce-scatter of grads (reduce dtype)]
                   forward gathers the params, backward keeps them, frees them after, so the next
                   microbatch gathers again: Composer applies `no_sync` to DDP only, not to FSDP
    FULL_SHARD     A x [2 all-gathers (forward and backward) + 1 reduce-scatter]
    NO_SHARD       A x [1 all-reduce of the grads] (FSDP without sharding)
    DDP            1 all-reduce of the grads per step (fsdp=false: Composer wraps accumulation in no_sync)

  With `no_sync` under FSDP (the train job's `fsdp_no_sync`, train/loop/step.py): SHARD_GRAD_OP and
  NO_SHARD communicate once per step (the gathered params stay alive between microbatches); FULL_SHARD
  still gathers twice per microbatch but reduce-scatters once per step.

    all-gather bytes    = (W-1)/W x P x param bytes     (bf16 under amp_bf16: 2)
    reduce-scatter bytes = (W-1)/W x P x reduce bytes   (fsdp_reduce_dtype: fp32 4, bf16 2)
    all-reduce bytes    = 2 (W-1)/W x P x reduce bytes

Checkpoint (fp32 weights, the EMA copy and AdamW's two moments): 4P + 4P + 8P = 16P bytes. Written full by
rank 0 it goes out of one node; sharded, every rank writes 16P/W and a node 16P/nodes, all nodes at once:

    save seconds = bytes written by the busiest node / write bandwidth per node
    step seconds = global batch / (images/s per GPU x W)
    save share   = save seconds / (save_interval x step seconds + save seconds)

SD2-base, 256 A100s, global batch 2048, microbatch 8 (A = 1), SHARD_GRAD_OP, bf16 params, fp32 reduce:
all-gather 255/256 x 865,910,724 x 2 = 1.725 GB, reduce-scatter 3.450 GB per rank per step; checkpoint
13.85 GB, 54.1 MB per rank sharded; at 1 GB/s per node a full save takes 13.9 s, a sharded one 0.43 s;
at 184.6 img/s per GPU a step is 43.3 ms, so saving every 2500 batches costs 11.3 % (full) or 0.40 %
(sharded) of wall time.

The state update, per rank per optimizer step: after backward each rank runs the job's gradient clipping,
its fused AdamW step and its EMA update over the parameters it holds, memory-bound kernels whose device time
is their bytes over the GPU's memory bandwidth. HBM bytes per fp32 parameter, reads + writes:

    clipping    4   the norm reads every gradient once (the scale is folded into the fused step)
    AdamW      32   torch's fused kernel reads param, grad, exp_avg, exp_avg_sq and writes all four: given a
                    grad_scale (the folded clipping) it also stores the unscaled gradient; 28 without one
    EMA        12   the foreach lerp reads the average and the param, writes the average; / ema interval

FSDP's sharded strategies (SHARD_GRAD_OP, FULL_SHARD) update 1/W of the parameters on each rank; DDP and
NO_SHARD update all of them on every rank. SD2-base, 48 B a parameter: 41.6 GB a step on every rank under
DDP, 8.7 ms at an H200's 4.8 TB/s and 26.7 ms at an A100-40GB's 1.555 TB/s, beside 12.5 ms of U-Net work
for 8 images at 256 px on an H200 at 35% MFU; 0.16 GB (0.03 ms) under SHARD_GRAD_OP on 256 ranks. `make
bench`'s anatomy counts these bytes op by op (anatomy.eager.state_update_bytes_per_param).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.estimate.gpus import GPU_TABLE

# diffusers UNet2DConditionModel with the sd2-base preset's shapes (shared/presets.py), counted with
# sum(p.numel() for p in unet.parameters()).
PRESET_PARAMS = {"sd2-base": 865_910_724, "tiny": 792_964}
# The best published SD2-base training throughput on A100s (MosaicML, "Training Stable Diffusion from
# Scratch for <$50k", 2023): images/s per GPU by resolution, ~32 % MFU.
PUBLISHED_IMAGES_PER_S_PER_A100 = {256: 184.6, 512: 42.2}
# U-Net train step (forward + backward) per image, GFLOP, by resolution (torch.utils.flop_counter at
# SD2-base's shapes; NOTES: 543 / 2,413).
UNET_STEP_GFLOP = {"sd2-base": {256: 543.0, 512: 2413.0}}
# The MFU a step's device time is priced at where nothing was measured on that GPU: issue 30's 256 px target.
REFERENCE_MFU = 0.35
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
WEIGHT_BYTES, EMA_BYTES, ADAMW_BYTES = 4, 4, 8  # per parameter, fp32 (AdamW: exp_avg + exp_avg_sq)
# The state update's HBM bytes per fp32 parameter and step (module doc), counted op by op on the job's step.
STATE_UPDATE_BYTES = {"clipping": 4, "optimizer": 32, "ema": 12}
ADAMW_BYTES_UNSCALED = 28  # the fused step without a grad_scale (no clipping): the gradient is not stored
SHARDED_STRATEGIES = ("SHARD_GRAD_OP", "FULL_SHARD")
DEFAULT_WRITE_GB_PER_S_PER_NODE = 1.0  # a node uploading to S3 or writing a shared filesystem, GB/s
SAVE_SHARE_TARGET = 0.01  # saving should cost under 1 % of wall time
GB = 1e9

Strategy = Literal["SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD", "DDP"]
# Collectives per microbatch (FSDP) or per step (DDP): (all-gathers, reduce-scatters, all-reduces).
_COLLECTIVES: dict[str, tuple[int, int, int]] = {
    "SHARD_GRAD_OP": (1, 1, 0),
    "FULL_SHARD": (2, 1, 0),
    "NO_SHARD": (0, 0, 1),
    "DDP": (0, 0, 1),
}


@dataclass(frozen=True)
class StepComm:
    """Collectives and bytes each rank sends (and receives) per optimizer step."""

    all_gathers: int
    reduce_scatters: int
    all_reduces: int
    all_gather_bytes: float
    reduce_scatter_bytes: float
    all_reduce_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.all_gather_bytes + self.reduce_scatter_bytes + self.all_reduce_bytes


def step_comm(
    params: int,
    world_size: int,
    grad_accum: int,
    strategy: Strategy,
    param_bytes: int,
    reduce_bytes: int,
    no_sync: bool = False,
) -> StepComm:
    """The module docstring's communication formulas; `no_sync`: FSDP accumulates without syncing."""
    gathers, scatters, reduces = _COLLECTIVES[strategy]
    per_step = 1 if strategy == "DDP" else grad_accum
    gather_times = 1 if no_sync and strategy == "SHARD_GRAD_OP" else per_step
    reduce_times = 1 if no_sync else per_step
    ring = (world_size - 1) / world_size
    return StepComm(
        all_gathers=gathers * gather_times,
        reduce_scatters=scatters * reduce_times,
        all_reduces=reduces * reduce_times,
        all_gather_bytes=gathers * gather_times * ring * params * param_bytes,
        reduce_scatter_bytes=scatters * reduce_times * ring * params * reduce_bytes,
        all_reduce_bytes=reduces * reduce_times * 2 * ring * params * reduce_bytes,
    )


@dataclass(frozen=True)
class CheckpointCost:
    total_bytes: float  # weights + EMA + AdamW state
    per_rank_bytes: float  # sharded: what each rank writes
    full_save_s: float  # rank 0 writes everything from one node
    sharded_save_s: float  # every node writes its ranks' shards at once


def checkpoint_cost(
    params: int, world_size: int, nodes: int, write_gb_per_s_per_node: float
) -> CheckpointCost:
    total = params * (WEIGHT_BYTES + EMA_BYTES + ADAMW_BYTES)
    bandwidth = write_gb_per_s_per_node * GB
    return CheckpointCost(total, total / world_size, total / bandwidth, total / nodes / bandwidth)


@dataclass(frozen=True)
class StateUpdate:
    """HBM bytes each rank's clipping, fused AdamW step and EMA update move per optimizer step."""

    bytes_per_param: float  # per step: the EMA's share divided by its interval
    params: int
    world_size: int
    sharded: bool  # each rank updates 1/world_size of the parameters (FSDP's sharded strategies)
    parts: tuple[str, ...]  # what runs: clipping norm, fused AdamW, EMA lerp
    ema_bytes_per_param: float  # the EMA's share of bytes_per_param

    @property
    def params_per_rank(self) -> float:
        return self.params / self.world_size if self.sharded else float(self.params)

    @property
    def per_rank_bytes(self) -> float:
        return self.bytes_per_param * self.params_per_rank

    def seconds(self, memory_tb_s: float) -> float:
        """Device time at the GPU's memory bandwidth (these kernels do little arithmetic per byte)."""
        return self.per_rank_bytes / (memory_tb_s * 1e12)


def state_update(
    params: int, world_size: int, strategy: Strategy, clipping: bool, ema_interval: int | None
) -> StateUpdate:
    """The module docstring's state update: `ema_interval` in batches, None without an EMA."""
    adamw = STATE_UPDATE_BYTES["optimizer"] if clipping else ADAMW_BYTES_UNSCALED
    ema = STATE_UPDATE_BYTES["ema"] / ema_interval if ema_interval else 0.0
    per_param = adamw + (STATE_UPDATE_BYTES["clipping"] if clipping else 0) + ema
    sharded = strategy in SHARDED_STRATEGIES and world_size > 1
    parts = ("clipping norm",) * clipping + ("fused AdamW",) + ("EMA lerp",) * bool(ema_interval)
    return StateUpdate(per_param, params, world_size, sharded, parts, ema)


def unet_device_seconds(preset: str, resolution: int, images: int, gpu_type: str) -> float | None:
    """The U-Net's forward + backward on `images` at `resolution` on `gpu_type` at REFERENCE_MFU; None
    where the preset's FLOPs are not known."""
    gflop = UNET_STEP_GFLOP.get(preset, {}).get(resolution)
    if gflop is None:
        return None
    return images * gflop * 1e9 / (GPU_TABLE[gpu_type].peak_bf16_tflops * 1e12 * REFERENCE_MFU)


# A replicated state update worth a note: at least this share of the U-Net's own device time a step (issue 30)
UPDATE_SHARE_NOTED = 0.1


def state_update_lines(
    update: StateUpdate, strategy: Strategy, gpu_type: str, fused: bool, device_s: float | None, images: str
) -> tuple[str, str]:
    """The dry-run plan's line on each rank's state update (HBM bytes, time at `gpu_type`'s bandwidth), and a
    note where an unsharded one on several ranks costs UPDATE_SHARE_NOTED or more of the U-Net's own device
    time a step (`device_s`, for `images`: unet_device_seconds) on that GPU."""
    bandwidth = GPU_TABLE[gpu_type].memory_tb_s
    update_s = update.seconds(bandwidth)
    world = update.world_size
    whose = f"1/{world} of the parameters on each rank" if update.sharded else "every parameter on every rank"
    # torch's foreach AdamW makes more passes over the same tensors: 108 B in all (make bench counts it)
    at_least, unfused = (
        ("", "") if fused else ("at least ", "; optimizer.fused=false moves more: make bench counts it")
    )
    line = (
        f"state update per rank per step ({' + '.join(update.parts)}, {at_least}"
        f"{update.bytes_per_param:g} B a parameter, {whose}): {update.per_rank_bytes / GB:.3f} GB = "
        f"{update_s * 1000:.2f} ms at the {gpu_type}'s {bandwidth:g} TB/s{unfused}"
    )
    if device_s is None or update.sharded or world == 1 or update_s < UPDATE_SHARE_NOTED * device_s:
        return line, ""
    ema, total = update.ema_bytes_per_param, update.bytes_per_param
    ema_clause = (
        f"; a longer ema.update_interval cuts only the EMA's {ema:g} of the {total:g} B" if ema else ""
    )
    return line, (
        f"{strategy} runs the whole state update on every rank: {update_s * 1000:.1f} ms a step on the "
        f"{gpu_type}, {update_s / device_s:.0%} on top of the U-Net's own {device_s * 1000:.1f} ms for "
        f"{images} at {REFERENCE_MFU:.0%} MFU, against {update_s / world * 1000:.2f} ms under FSDP's "
        f"SHARD_GRAD_OP: more images per GPU shrink its share{ema_clause}"
    )


# Issue 30's sixth GPU run (one H200, torch 2.11): sd2-base-256 / -512 as run (FSDP per block, compiled, one
# microbatch of 8 per GPU) took 0.297 / 0.275 s a batch at 256 / 512 px, the same at either resolution: the
# host's work a step, which the device waits on wherever its own work on the microbatch is shorter. Counted
# on a CPU (make bench's trainer.host_twin), most of it is per-block FSDP's: +9.7 ATen ops and +81 Python
# calls a parameter tensor a step, 686 of them in SD2's U-Net, whatever the batch.
FSDP_HOST_SECONDS_PER_STEP = 0.275
HOST_BOUND_MARGIN = 1.1  # noted where the cap costs at least 10% (a rate measured at 8 per GPU is at it)


def host_bound_note(fsdp: bool, microbatch: int, images_per_s_per_gpu: float, ddp: str = "") -> str:
    """Where the planned images/s per GPU needs less time a microbatch than the host's work a step took under
    per-block FSDP: the ceiling that host time puts on the rate, and what it does to the GPU-hours; `ddp`:
    what fsdp=false would keep and cost on this GPU, where it fits (shared/estimate/memory.py
    `ddp_alternative`)."""
    device_s = microbatch / images_per_s_per_gpu
    ceiling = microbatch / FSDP_HOST_SECONDS_PER_STEP
    if not fsdp or images_per_s_per_gpu < HOST_BOUND_MARGIN * ceiling:
        return ""
    return (
        f"{microbatch} images per GPU a microbatch under per-block FSDP: the estimate's measured "
        f"{images_per_s_per_gpu:,.1f} img/s per GPU (before scaling) needs {1000 * device_s:.0f} ms a "
        "microbatch, under the "
        f"{FSDP_HOST_SECONDS_PER_STEP} s of host work a step took on an H200 at 8 per GPU (issue 30; "
        f"docs/performance.md): expect at most {ceiling:,.1f} img/s per GPU, "
        f"{images_per_s_per_gpu / ceiling:.1f}x the estimate's GPU-hours. More images per GPU (the memory "
        f"line: fewer GPUs){'; or fsdp=false: ' + ddp if ddp else ''}; or measure yours: make bench "
        "BENCH=full, then make estimate ARGS='throughput_from=outputs/bench/bench.json'"
    )


def step_seconds(global_batch: int, images_per_s_per_gpu: float, world_size: int) -> float:
    return global_batch / (images_per_s_per_gpu * world_size)


def save_share(save_s: float, interval_batches: int, step_s: float) -> float:
    """Fraction of wall time spent saving when a save of `save_s` follows every `interval_batches` steps."""
    return save_s / (interval_batches * step_s + save_s)


def min_interval_for_share(save_s: float, step_s: float, share: float = SAVE_SHARE_TARGET) -> int:
    """The smallest save interval (batches) that keeps saving under `share` of wall time."""
    return int(save_s * (1 - share) / (share * step_s)) + 1
