"""The planner's typed config (`jobs/estimate/<name>.yaml` + `key=value` overrides)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import load_config
from shared.config.values import allowed
from shared.estimate.cluster import UNET_STEP_GFLOP
from shared.estimate.gpus import (
    DEFAULT_CONFIG,
    DEFAULT_OUT_DIR,
    DEFAULT_SWEEP,
    GPU_TABLE,
    SD2_GLOBAL_BATCH,
    SD2_SCHEDULE,
    PricingMode,
    ScalingModel,
    _check_by_resolution,
    _require,
    canonical_gpu_type,
)
from shared.estimate.memory import ACTIVATION_BYTES_PER_IMAGE, Strategy

# ----------------------------------------------------------------------------------------------- config


@dataclass
class PhaseConfig:
    """One stretch of the schedule at one resolution."""

    resolution: int = allowed(ge=1)  # px; needs a throughput for this resolution
    samples: int = allowed(ge=1)  # training samples seen in this phase (steps x global batch)
    name: str = ""  # label in the outputs; "" -> phase<i>-<resolution>


def _sd2_schedule() -> list[PhaseConfig]:
    return [PhaseConfig(res, samples, f"phase{i}-{res}") for i, (res, samples) in enumerate(SD2_SCHEDULE, 1)]


@dataclass
class GpuConfig:
    type: str = "A100-40GB"  # one of GPU_TABLE (case-insensitive)

    def __post_init__(self) -> None:
        self.type = canonical_gpu_type(self.type)


@dataclass
class ThroughputConfig:
    # Training images/s per GPU by resolution (px), measured on scaling.reference_gpus GPUs.
    per_gpu: dict[str, float] = allowed(default_factory=dict, gt=0)
    # GPU type the numbers were measured on; "" -> gpu.type. Planning another type adds a warning.
    measured_on: str = ""
    # Planning another GPU type: multiply by the ratio of peak bf16 TFLOP/s. Optimistic (an upper bound):
    # real speedups trail peak ratios; measure with `make bench` on the target GPU instead when you can.
    scale_by_peak_flops: bool = False

    def __post_init__(self) -> None:
        _check_by_resolution(self.per_gpu, "throughput.per_gpu")
        if self.measured_on:
            self.measured_on = canonical_gpu_type(self.measured_on)


@dataclass
class ScalingConfig:
    # log2: `efficiency` is kept per doubling beyond reference_gpus; constant: kept at any N > reference.
    model: ScalingModel = "log2"
    efficiency: float = allowed(1.0, gt=0, le=1)  # 1.0 = perfect linear scaling
    reference_gpus: int = allowed(8, ge=1)  # GPU count the per-GPU throughput was measured on
    # Per-resolution override of `efficiency` (small 256 px steps lose more to communication than 512 px).
    per_resolution: dict[str, float] = allowed(default_factory=dict, gt=0, le=1)
    # Fraction of wall-clock time spent in training steps (checkpoints, evals, restarts take the rest).
    goodput: float = allowed(1.0, gt=0, le=1)

    def __post_init__(self) -> None:
        _check_by_resolution(self.per_resolution, "scaling.per_resolution")

    def efficiency_for(self, resolution: int) -> float:
        return self.per_resolution.get(str(resolution), self.efficiency)


@dataclass
class PricingConfig:
    mode: PricingMode = "on_demand"
    # USD per GPU-hour; None -> GPU_TABLE's list price for the GPU type.
    on_demand_per_gpu_hour: float | None = None
    reserved_per_gpu_hour: float | None = None

    def per_gpu_hour(self, gpu_type: str) -> float:
        spec = GPU_TABLE[gpu_type]
        if self.mode == "reserved":
            given, listed = self.reserved_per_gpu_hour, spec.reserved_per_gpu_hour
        else:
            given, listed = self.on_demand_per_gpu_hour, spec.on_demand_per_gpu_hour
        return listed if given is None else given


@dataclass
class EncodeCostConfig:
    samples: int = 0  # source samples the encode job reads (dataset size); 0 = leave encode out
    images_per_s_per_gpu: float = 0.0  # source images encoded per s per GPU, every resolution included
    gpus: int = allowed(8, ge=1)  # encoder GPUs (sets encode days; GPU-hours do not depend on it)
    gpu_type: str = ""  # "" -> gpu.type
    price_per_gpu_hour: float | None = None  # None -> pricing.mode's price for gpu_type

    def __post_init__(self) -> None:
        if self.gpu_type:
            self.gpu_type = canonical_gpu_type(self.gpu_type)


@dataclass
class StorageConfig:
    # An encode output root or its manifest.json (local or s3://): bytes/sample and kept share per
    # resolution are read from it and replace bytes_per_sample; "" = use bytes_per_sample.
    manifest: str = ""
    bytes_per_sample: dict[str, float] = allowed(default_factory=dict, gt=0)  # by resolution (px)
    # Samples kept per resolution; empty -> encode.samples times the manifest's kept share (or all of them).
    samples: dict[str, int] = field(default_factory=dict)
    price_per_gib_month: float = 0.023  # AWS S3 Standard, first 50 TB/month, us-east-1
    months: float = 3.0  # how long the shards are kept

    def __post_init__(self) -> None:
        _check_by_resolution(self.bytes_per_sample, "storage.bytes_per_sample")
        _check_by_resolution(self.samples, "storage.samples", allow_zero=True)


TEXT_MODES = ("embeddings", "tokens")  # text.store (shared/estimate/text_store.py prices both)


@dataclass
class TextCostConfig:
    """What a sample's text costs in each mode (defaults: SD2-base, OpenCLIP ViT-H/14 text tower)."""

    # 77 x 1024 float16 (shared/contract.py TEXT_EMBEDDING) and 77 x uint16 (TEXT_TOKENS).
    embedding_bytes: int = allowed(157_696, ge=1)
    token_bytes: int = allowed(154, ge=1)
    # The mode storage.bytes_per_sample was measured in; a storage.manifest replaces it with its own.
    measured_store: str = "embeddings"
    # Text tower forward per sample: 23 blocks (penultimate layer) x 77 tokens x ~12 x 1024^2 x 2 FLOP plus
    # attention ~ 45 GFLOP (torch.utils.flop_counter at SD2 shapes).
    tower_gflop_per_sample: float = 45.0
    # U-Net train step (forward + backward) per sample by resolution (shared/estimate/cluster.py's table).
    unet_step_gflop: dict[str, float] = allowed(
        default_factory=lambda: {str(res): g for res, g in UNET_STEP_GFLOP["sd2-base"].items()}, gt=0
    )
    gpus_per_node: int = allowed(8, ge=1)

    def __post_init__(self) -> None:
        _require(self.measured_store in TEXT_MODES, f"text.measured_store must be one of {list(TEXT_MODES)}")
        _check_by_resolution(self.unet_step_gflop, "text.unet_step_gflop")

    def text_bytes(self, mode: str) -> int:
        return self.token_bytes if mode == "tokens" else self.embedding_bytes


@dataclass
class MemoryConfig:
    """The train recipes' batch per GPU against gpu.type's memory (shared/estimate/memory.py); the
    defaults are jobs/train/sd2-base-256.yaml's and -512.yaml's (a test keeps them equal)."""

    preset: str = "sd2-base"  # a preset with measured activations (ACTIVATION_BYTES_PER_IMAGE)
    # device_microbatch_size by resolution (px); a schedule resolution not listed is not checked.
    microbatch: dict[str, int] = allowed(default_factory=lambda: {"256": 8, "512": 8}, ge=1)
    global_batch: int = allowed(SD2_GLOBAL_BATCH, ge=1)  # global_batch_size (per rank: / gpus)
    strategy: Strategy = "SHARD_GRAD_OP"  # fsdp_sharding_strategy, or DDP for fsdp=false

    def __post_init__(self) -> None:
        _check_by_resolution(self.microbatch, "memory.microbatch")
        known = sorted({preset for preset, _ in ACTIVATION_BYTES_PER_IMAGE})
        _require(self.preset in known, f"memory.preset must be one of {known}, got {self.preset!r}")


@dataclass
class EstimateConfig:
    """Everything `make estimate` needs; `jobs/estimate/sd2-base.yaml` documents the defaults' sources."""

    gpus: int = allowed(128, ge=1)  # training GPU count
    gpu: GpuConfig = field(default_factory=GpuConfig)
    schedule: list[PhaseConfig] = field(default_factory=_sd2_schedule)
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    throughput_from: str = ""  # a `make bench` JSON (schema: module docstring); replaces throughput.per_gpu
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    pricing: PricingConfig = field(default_factory=PricingConfig)
    encode: EncodeCostConfig = field(default_factory=EncodeCostConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    text: TextCostConfig = field(default_factory=TextCostConfig)  # text.store: embeddings vs tokens
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # the batch per GPU memory allows
    # GPU counts for the plot
    sweep: list[int] = allowed(default_factory=lambda: list(DEFAULT_SWEEP), ge=1)
    out_dir: str = DEFAULT_OUT_DIR

    def __post_init__(self) -> None:
        _require(bool(self.schedule), "schedule is empty; list at least one {resolution, samples} phase")
        for i, phase in enumerate(self.schedule, 1):
            phase.name = phase.name or f"phase{i}-{phase.resolution}"

    @property
    def encode_gpu_type(self) -> str:
        return self.encode.gpu_type or self.gpu.type

    @property
    def measured_on(self) -> str:
        return self.throughput.measured_on or self.gpu.type


def load_estimate_config(
    config: str | Path = DEFAULT_CONFIG, overrides: Sequence[str] = ()
) -> EstimateConfig:
    """`jobs/estimate/<config>.yaml` (or a path) + `key=value` overrides."""
    return load_config(EstimateConfig, config, overrides, kind="estimate")
