"""The batch per GPU from the GPU's memory (instead of a fixed A100-era value): what stays resident per
parameter, what one image's activations take, and how many images fit beside it.

Resident bytes per parameter for this job (fp32 master weights, AdamW with two moments, an EMA copy):

    without FSDP (one GPU, DDP):  weights 4 + grads 4 + AdamW 8 + EMA 4                     = 20 B
    FSDP SHARD_GRAD_OP on W ranks: (4 + 4 + 8 + 4) / W + 2 (bf16 params gathered for the
                                   whole forward and backward)                              = 20 / W + 2 B
    FSDP FULL_SHARD on W ranks:   (4 + 4 + 8 + 4) / W (one block gathered at a time)        = 20 / W B

Activations per image are measured (`make bench`'s anatomy section: bytes saved for backward at batch b
and 2b, the difference over b), so they follow the precision, attention kernel and switches of the run.
A fixed share of memory is kept back for the allocator's fragmentation, cuDNN / cuBLAS workspaces,
gradient buckets and the transient tensors of backward.

ACTIVATION_BYTES_PER_IMAGE holds that measurement for the shipped GPU recipes, so `make estimate` and the
train dry run (`memory_check`) can say how much of a GPU the recipe's `device_microbatch_size` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from shared.estimate.cluster import PRESET_PARAMS, StateUpdate, state_update
from shared.estimate.gpus import GPU_TABLE

Strategy = Literal["DDP", "SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD"]
STATE_BYTES_PER_PARAM = 4 + 4 + 8 + 4  # fp32 weights, fp32 grads, AdamW exp_avg + exp_avg_sq, EMA
GATHERED_PARAM_BYTES = 2  # bf16 params FSDP keeps gathered between forward and backward (SHARD_GRAD_OP)
USABLE_SHARE = 0.85  # of device memory: the rest for fragmentation, workspaces and backward's transients

# The train recipes ACTIVATION_BYTES_PER_IMAGE was measured from (jobs/train/<name>.yaml + overrides): the
# shipped GPU recipes, and the tiny preset under the same switches (tests re-measure that one, cheaply).
MEASURED_RECIPES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sd2-base-256", ()),
    ("sd2-base-512", ()),
    ("sd2-base-256", ("model.preset=tiny", "data.resolution=64")),
)


def resident_bytes(params: int, world_size: int = 1, strategy: Strategy = "DDP") -> float:
    """Bytes per GPU that do not depend on the batch (module doc)."""
    if strategy in ("DDP", "NO_SHARD") or world_size <= 1:
        return float(STATE_BYTES_PER_PARAM * params)
    sharded = STATE_BYTES_PER_PARAM * params / world_size
    return sharded + (GATHERED_PARAM_BYTES * params if strategy == "SHARD_GRAD_OP" else 0.0)


@dataclass(frozen=True)
class BatchFit:
    """The largest batch per GPU that fits, and the power of two at or below it (what a recipe would pick:
    it divides the usual global batches)."""

    max_images: int
    power_of_two: int
    resident_gb: float
    activation_gb_per_image: float
    usable_gb: float

    def to_json(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def batch_that_fits(
    memory_gb: float,
    activation_bytes_per_image: float,
    params: int,
    world_size: int = 1,
    strategy: Strategy = "DDP",
    usable_share: float = USABLE_SHARE,
) -> BatchFit:
    """Images per GPU that fit in `memory_gb` (GB = 1e9 bytes) next to the resident state (module doc)."""
    if activation_bytes_per_image <= 0:
        raise ValueError(f"activation bytes per image must be > 0, got {activation_bytes_per_image}")
    usable = memory_gb * 1e9 * usable_share
    resident = resident_bytes(params, world_size, strategy)
    images = max(0, int((usable - resident) // activation_bytes_per_image))
    power = 1 << (images.bit_length() - 1) if images else 0
    return BatchFit(images, power, resident / 1e9, activation_bytes_per_image / 1e9, usable / 1e9)


# Activation bytes saved for backward per image, by (preset, resolution px), as the shipped GPU recipes run:
# bf16 autocast (CUDA's policy), SDPA attention, model.low_precision_norms=true, eager, no gradient
# checkpointing, one forward + loss at batch 1 vs 2. Measured on a CPU with CUDA's autocast policy emulated
# (train/bench/anatomy/memory.py says why the bytes are a GPU's); re-measure (prints these lines):
#     PYTHONPATH=. .venv/bin/python -m train.bench.anatomy.memory
# tests/train/test_launch_memory.py re-measures the tiny entry, so a change in what autograd saves shows.
# torch.compile saves less (inductor recomputes cheap ops in backward): these are an upper bound for it.
ACTIVATION_BYTES_PER_IMAGE: dict[tuple[str, int], float] = {
    ("sd2-base", 256): 241_999_812,  # sd2-base-256
    ("sd2-base", 512): 941_111_556,  # sd2-base-512
    ("tiny", 64): 747_044,  # sd2-base-256 model.preset=tiny data.resolution=64
}
MEASURED_AS = "bf16 autocast, SDPA, low_precision_norms, eager, no gradient checkpointing"
REMEASURE = "python -m train.bench.anatomy.memory"
UNUSED_SHARE = 0.5  # a batch using less than this share of the GPU's memory leaves most of it unused


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of n that is <= at_most (0 if none): a microbatch must divide the rank's batch."""
    return max((d for d in range(1, min(n, at_most) + 1) if n % d == 0), default=0)


def measured_sizes(preset: str, resolution: int) -> tuple[float, int] | None:
    """(activation bytes per image, parameters) of the preset at this resolution; None where no activations
    were measured."""
    per_image = ACTIVATION_BYTES_PER_IMAGE.get((preset, resolution))
    params = PRESET_PARAMS.get(preset)
    return (per_image, params) if per_image and params is not None else None


def microbatch_that_fits(
    memory_gb: float, preset: str, resolution: int, per_rank_batch: int, world_size: int, strategy: Strategy
) -> int | None:
    """The largest microbatch that divides the rank's batch and fits in `memory_gb` beside the resident state
    (at least 1: a run that fits none is warned about by its memory line); None where no activation bytes were
    measured for the preset and resolution."""
    sizes = measured_sizes(preset, resolution)
    if sizes is None:
        return None
    fit = batch_that_fits(memory_gb, *sizes, world_size, strategy)
    return largest_divisor(per_rank_batch, fit.max_images) or 1


@dataclass(frozen=True)
class MemoryCheck:
    """The recipe's microbatch against one GPU type's memory (module doc)."""

    gpu_type: str
    memory_gb: float
    preset: str
    resolution: int
    microbatch: int  # device_microbatch_size
    world_size: int
    strategy: Strategy
    global_batch: int | None  # global_batch_size, when known
    fit: BatchFit

    @property
    def used_gb(self) -> float:
        """Resident state + the microbatch's activations (before the allocator's share)."""
        return self.fit.resident_gb + self.microbatch * self.fit.activation_gb_per_image

    @property
    def fits(self) -> bool:
        return self.microbatch <= self.fit.max_images

    @property
    def mostly_unused(self) -> bool:
        return self.fits and self.used_gb < UNUSED_SHARE * self.memory_gb

    @property
    def per_rank_batch(self) -> int | None:
        if self.global_batch is None or self.global_batch % self.world_size:
            return None
        return self.global_batch // self.world_size

    def advice(self) -> str:
        """What to change, or "fits" when the microbatch fits and nothing larger helps."""
        most, power, per_rank = self.fit.max_images, self.fit.power_of_two, self.per_rank_batch
        if not self.fits:
            if most == 0:
                return (
                    "does NOT fit, not even 1 image: fsdp_sharding_strategy=FULL_SHARD or "
                    "model.gradient_checkpointing=true"
                )
            smaller = largest_divisor(per_rank, most) if per_rank else power
            return f"does NOT fit: set device_microbatch_size={smaller} (accumulation keeps the global batch)"
        bigger = largest_divisor(per_rank, most) if per_rank else 0
        if not self.mostly_unused or (per_rank and bigger <= self.microbatch < per_rank):
            return "fits"  # uses most of it, or no larger microbatch divides the rank's batch
        if bigger > self.microbatch:
            more = "; more per GPU needs a larger global_batch_size or fewer GPUs" if power > bigger else ""
            return (
                f"most of it unused: set device_microbatch_size={bigger} (fewer accumulation steps, same "
                f"global batch){more}"
            )
        if power <= self.microbatch:
            return "fits"
        # The global batch is a hyperparameter: the same on fewer GPUs, or what a larger one costs.
        fewer = ""
        if (
            self.global_batch
            and self.global_batch % power == 0
            and self.global_batch // power < self.world_size
        ):
            fewer = f"this global batch on {self.global_batch // power} GPUs, or "
        return (
            f"most of it unused: up to {power} per GPU fit; {fewer}global_batch_size="
            f"{power * self.world_size} with device_microbatch_size={power} "
            "(a new recipe: retune the learning rate)"
        )

    def line(self) -> str:
        """One line for `make estimate` and the train dry run."""
        fit, ranks = self.fit, f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return (
            f"{self.resolution} px on {self.gpu_type}: {self.microbatch} per GPU uses {self.used_gb:.1f} GB "
            f"of {self.memory_gb:g} GB ({fit.resident_gb:.1f} GB resident, {self.strategy} on "
            f"{ranks}, + {fit.activation_gb_per_image:.3f} GB activations per image); "
            f"up to {fit.max_images} fit ({fit.power_of_two} as a power of two); {self.advice()}"
        )

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__, fit=self.fit.to_json())
        out.update(used_gb=self.used_gb, fits=self.fits, mostly_unused=self.mostly_unused, line=self.line())
        return out


def memory_check(
    gpu_type: str,
    preset: str,
    resolution: int,
    microbatch: int,
    world_size: int = 1,
    strategy: Strategy = "DDP",
    global_batch: int | None = None,
    memory_gb: float | None = None,
) -> MemoryCheck | str:
    """The check for a GPU_TABLE type, or why there is none (no measurement for this preset and size);
    `memory_gb`: the memory of the GPU a run found (`gpu_type` then only names it)."""
    sizes = measured_sizes(preset, resolution)
    memory_gb = memory_gb or GPU_TABLE[gpu_type].memory_gb
    if sizes is None or not memory_gb:
        return (
            f"no measured activation bytes for {preset} at {resolution} px on {gpu_type} "
            f"(`{REMEASURE}` measures the shipped recipes; shared/estimate/memory.py keeps them)"
        )
    fit = batch_that_fits(memory_gb, *sizes, world_size, strategy)
    return MemoryCheck(
        gpu_type, memory_gb, preset, resolution, microbatch, world_size, strategy, global_batch, fit
    )


# A bare step of SD2's U-Net module tree (preset sd2-base-slim, eager, microbatch 8) on the 2-core CPU box,
# make bench's trainer.host_twin: (top-level ATen ops, Python calls) with FSDP per block, and unwrapped.
HOST_TWIN_STEP_FSDP = (11_623, 64_774)
HOST_TWIN_STEP_UNWRAPPED = (4_942, 8_948)
# What DDP adds to that step, counted on 2 gloo ranks (tests/train/loop/test_compiled.py): 2 ATen ops per
# gradient tensor, its view into a bucket (train/loop/compiled.py) and a scaling by 1/world, a kernel each
# of SD2's U-Net's 686.
SD2_GRADIENT_TENSORS = 686


def ddp_alternative(
    gpu_type: str, preset: str, resolution: int, microbatch: int, update: StateUpdate | None = None
) -> str:
    """For shared/estimate/cluster.py's host_bound_note, where DDP's unsharded state and this microbatch
    fit `gpu_type`: what fsdp=false keeps on every GPU, the FSDP host work it drops, and its price (the
    whole state update on every GPU: `update`, else the recipes' clipping and EMA every step; full
    checkpoints: the job writes sharded ones only under FSDP); "" where it does not fit."""
    check = memory_check(gpu_type, preset, resolution, microbatch, 1, "DDP")
    if isinstance(check, str) or not check.fits:
        return ""
    update = update or state_update(PRESET_PARAMS[preset], 1, "DDP", clipping=True, ema_interval=1)
    bandwidth = GPU_TABLE[gpu_type].memory_tb_s
    (fsdp_ops, fsdp_calls), (ops, calls) = HOST_TWIN_STEP_FSDP, HOST_TWIN_STEP_UNWRAPPED
    fit = f"{check.used_gb:.1f} GB of {check.memory_gb:g} with {microbatch} images"
    counts = f"{ops:,} ATen ops and {calls:,} Python calls unwrapped, {fsdp_ops:,} and {fsdp_calls:,}"
    return (
        f"DDP keeps the whole {check.fit.resident_gb:.1f} GB of state on every GPU ({fit}) without FSDP's "
        f"per-unit host work (a bare step of SD2's module tree on a CPU: {counts} under per-block FSDP; "
        f"DDP adds 2 ops a gradient, its bucket view and a 1/world scaling: {SD2_GRADIENT_TENSORS} kernels; "
        "not yet timed on a GPU: the bench's no_fsdp variant), but runs the whole state update on every "
        f"GPU ({', '.join(update.parts)}: {update.per_rank_bytes / 1e9:.1f} GB a step, "
        f"{update.seconds(bandwidth) * 1000:.1f} ms at the {gpu_type}'s {bandwidth:g} TB/s; 1/world of it "
        "under FSDP), and writes full checkpoints, not sharded (the cluster line's full-save share)"
    )
