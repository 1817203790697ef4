"""The time-and-cost planner (`make estimate`): measured throughput -> days, GPU-hours and dollars.

Pure Python + matplotlib (imported only to draw the plot): no torch, no Composer, so it answers instantly.

Model, per schedule phase (one resolution, a number of training samples):

    efficiency(N) = 1                                         for N <= reference_gpus
                  = efficiency ** log2(N / reference_gpus)    scaling.model = log2 (kept per doubling)
                  = efficiency                                scaling.model = constant
    cluster images/s = images/s/GPU (measured on reference_gpus) * N * efficiency(N)
    wall hours       = samples / cluster images/s / 3600 / goodput
    GPU-hours        = wall hours * N;   dollars = GPU-hours * $/GPU-hour (pricing.mode)

plus the one-time encode (samples / (images/s/GPU * 3600) GPU-hours on the encoder GPUs) and storage of the
encoded shards (bytes/sample * samples kept, per resolution, * $/GiB-month * months).

`throughput_from=<bench.json>` reads the `make bench` result instead of `throughput.per_gpu`:

    {
      "device": "NVIDIA A100-SXM4-40GB",   # torch.cuda.get_device_name(); mapped to a GPU_TABLE type
      "num_devices": 8,                    # optional: GPUs the numbers were measured on; replaces
                                           #   scaling.reference_gpus
      "train": {                           # per resolution (px, as a string key)
        "256": {"images_per_s_per_device": 185.0},
        "512": {"images_per_s_per_device": 42.0}
      },
      "encode": {"images_per_s_per_device": 60.0}   # optional: source images encoded per s per GPU, all
                                                    #   resolutions of a sample included; or per resolution
                                                    #   {"256": {...}, "512": {...}} (times add up)
    }

`storage.manifest=<encode output root or manifest.json>` reads bytes per sample from a real encode:
`resolutions.<res>.bytes / num_samples.<res>` (see shared/manifest.py `DatasetManifest.to_json`), and the
share of read samples each resolution kept (`num_samples.<res> / samples_read`, images smaller than a
resolution are never upscaled) to size the full dataset from `encode.samples`.

The published runs this reproduces, with their inputs, are tabulated in tests/train/test_estimate.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import typer

from shared import storage
from shared.config import ConfigError, config_to_dict, load_config

SECONDS_PER_HOUR = 3600
HOURS_PER_DAY = 24
BYTES_PER_GIB = 2**30  # S3 bills storage in binary GB ("GB-month" = 2^30 bytes for a month)
DEFAULT_CONFIG = "sd2-base"
DEFAULT_OUT_DIR = "outputs/estimate"
DEFAULT_SWEEP = (8, 16, 32, 64, 128, 256, 512)
MANIFEST_FILE = "manifest.json"  # shared.manifest.MANIFEST_NAME (not imported: it pulls in numpy)

# The published SD2-base schedule (stabilityai/stable-diffusion-2-base model card): 550k steps at 256 px, then
# 850k steps at 512 px, global batch 32 x 8 x 2 x 4 = 2048 -> 1,126,400,000 and 1,740,800,000 samples.
SD2_GLOBAL_BATCH = 2048
SD2_SCHEDULE = ((256, 550_000 * SD2_GLOBAL_BATCH), (512, 850_000 * SD2_GLOBAL_BATCH))

PricingMode = Literal["on_demand", "reserved"]
ScalingModel = Literal["constant", "log2"]


@dataclass(frozen=True)
class GpuSpec:
    """What the planner knows about one GPU type."""

    name: str
    peak_bf16_tflops: float  # dense (no 2:4 sparsity), from NVIDIA's datasheet
    on_demand_per_gpu_hour: float  # USD, list price
    reserved_per_gpu_hour: float  # USD, reserved / committed capacity


# Peak bf16 dense TFLOP/s: NVIDIA A100 datasheet "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*" (* = with
# sparsity); H100 SXM and H200 datasheets "BF16 Tensor Core 1,979 TFLOPS*" -> 989 dense (same Hopper die).
# On-demand: AWS EC2 on-demand Linux, us-east-1, per instance / 8 GPUs, the list prices MosaicML and the SD2
# model card compare against: p4d.24xlarge (8x A100-40GB) $32.7726/h, p4de.24xlarge (8x A100-80GB)
# $40.9657/h, p5.48xlarge (8x H100) $98.32/h (The Next Platform, "H100 GPU Instance Pricing On AWS: Grin And
# Bear It", 2023-07-27), p5e.48xlarge (8x H200) ~$107/h (awsnegotiations.com, "AWS GPU Instance Cost
# Strategy", 2026). AWS cut P4/P5 on-demand prices by up to 45% in June 2025 (usage.ai, "LLM Cost
# Optimization on AWS"), so these are upper bounds: override pricing.on_demand_per_gpu_hour with your quote.
# Reserved: AWS "Amazon EC2 Capacity Blocks for ML Pricing", effective accelerator hourly rate (table valid
# until 2025-01-01): p4d $1.844, p5 $4.916, p5e (H200) $5.408. That table has no p4de row: A100-80GB is the
# p4d rate times the p4de/p4d on-demand ratio (40.9657 / 32.7726 = 1.25). For comparison, MosaicML's
# published SD2 estimates use $2 / A100-hour.
GPU_TABLE: dict[str, GpuSpec] = {
    "A100-40GB": GpuSpec("A100-40GB", 312.0, 4.10, 1.844),
    "A100-80GB": GpuSpec("A100-80GB", 312.0, 5.12, 2.31),
    "H100": GpuSpec("H100", 989.0, 12.29, 4.916),
    "H200": GpuSpec("H200", 989.0, 13.38, 5.408),
}


class EstimateError(ConfigError):
    """Planner input that cannot give an estimate (missing throughput, unreadable bench or manifest)."""


def canonical_gpu_type(name: str) -> str:
    """`h100` -> `H100`; an unknown type is an error naming the known ones."""
    for known in GPU_TABLE:
        if known.lower() == name.strip().lower():
            return known
    raise ConfigError(
        f"unknown GPU type {name!r}; known: {', '.join(GPU_TABLE)} (set gpu.type to one of them, and "
        "pricing.on_demand_per_gpu_hour / pricing.reserved_per_gpu_hour if your price differs)"
    )


def gpu_type_for_device(device_name: str) -> str | None:
    """Map `torch.cuda.get_device_name()` (e.g. `NVIDIA A100-SXM4-80GB`) to a GPU_TABLE type, if any."""
    name = device_name.upper()
    if "H200" in name:
        return "H200"
    if "H100" in name:
        return "H100"
    if "A100" in name:
        return "A100-80GB" if "80G" in name else "A100-40GB"
    return next((known for known in GPU_TABLE if known.upper() == name.strip()), None)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_by_resolution(values: Mapping[str, float], what: str, allow_zero: bool = False) -> None:
    """Keys are resolutions in px; values positive (or zero where `allow_zero`)."""
    for key, value in values.items():
        _require(key.strip().isdigit(), f"{what} keys are resolutions in px (e.g. 256), got {key!r}")
        ok = value >= 0 if allow_zero else value > 0
        _require(ok, f"{what}.{key} must be {'>=' if allow_zero else '>'} 0, got {value}")


# ----------------------------------------------------------------------------------------------- config


@dataclass
class PhaseConfig:
    """One stretch of the schedule at one resolution."""

    resolution: int  # px; needs a throughput for this resolution
    samples: int  # training samples seen in this phase (steps x global batch)
    name: str = ""  # label in the outputs; "" -> phase<i>-<resolution>

    def __post_init__(self) -> None:
        _require(self.resolution > 0, f"schedule: resolution must be > 0 px, got {self.resolution}")
        where = f"schedule ({self.resolution} px)"
        _require(self.samples > 0, f"{where}: samples must be > 0, got {self.samples}")


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
    per_gpu: dict[str, float] = field(default_factory=dict)
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
    efficiency: float = 1.0  # 1.0 = perfect linear scaling
    reference_gpus: int = 8  # GPU count the per-GPU throughput was measured on
    # Per-resolution override of `efficiency` (small 256 px steps lose more to communication than 512 px).
    per_resolution: dict[str, float] = field(default_factory=dict)
    # Fraction of wall-clock time spent in training steps (checkpoints, evals, restarts take the rest).
    goodput: float = 1.0

    def __post_init__(self) -> None:
        _check_by_resolution(self.per_resolution, "scaling.per_resolution")
        for key, value in {"": self.efficiency, **self.per_resolution}.items():
            name = f"scaling.per_resolution.{key}" if key else "scaling.efficiency"
            _require(0 < value <= 1, f"{name} must be in (0, 1] (1 = linear scaling), got {value}")
        _require(self.reference_gpus >= 1, f"scaling.reference_gpus must be >= 1, got {self.reference_gpus}")
        _require(0 < self.goodput <= 1, f"scaling.goodput must be in (0, 1], got {self.goodput}")

    def efficiency_for(self, resolution: int) -> float:
        return self.per_resolution.get(str(resolution), self.efficiency)


@dataclass
class PricingConfig:
    mode: PricingMode = "on_demand"
    # USD per GPU-hour; None -> GPU_TABLE's list price for the GPU type.
    on_demand_per_gpu_hour: float | None = None
    reserved_per_gpu_hour: float | None = None

    def __post_init__(self) -> None:
        for name in ("on_demand_per_gpu_hour", "reserved_per_gpu_hour"):
            value = getattr(self, name)
            _require(value is None or value >= 0, f"pricing.{name} must be >= 0, got {value}")

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
    gpus: int = 8  # encoder GPUs (sets encode days; GPU-hours do not depend on it)
    gpu_type: str = ""  # "" -> gpu.type
    price_per_gpu_hour: float | None = None  # None -> pricing.mode's price for gpu_type

    def __post_init__(self) -> None:
        _require(self.samples >= 0, f"encode.samples must be >= 0, got {self.samples}")
        _require(self.images_per_s_per_gpu >= 0, "encode.images_per_s_per_gpu must be >= 0")
        _require(self.gpus >= 1, f"encode.gpus must be >= 1, got {self.gpus}")
        p = self.price_per_gpu_hour
        _require(p is None or p >= 0, f"encode.price_per_gpu_hour must be >= 0, got {p}")
        if self.gpu_type:
            self.gpu_type = canonical_gpu_type(self.gpu_type)


@dataclass
class StorageConfig:
    # An encode output root or its manifest.json (local or s3://): bytes/sample and kept share per
    # resolution are read from it and replace bytes_per_sample; "" = use bytes_per_sample.
    manifest: str = ""
    bytes_per_sample: dict[str, float] = field(default_factory=dict)  # by resolution (px)
    # Samples kept per resolution; empty -> encode.samples times the manifest's kept share (or all of them).
    samples: dict[str, int] = field(default_factory=dict)
    price_per_gib_month: float = 0.023  # AWS S3 Standard, first 50 TB/month, us-east-1
    months: float = 3.0  # how long the shards are kept

    def __post_init__(self) -> None:
        _check_by_resolution(self.bytes_per_sample, "storage.bytes_per_sample")
        _check_by_resolution(self.samples, "storage.samples", allow_zero=True)
        for name in ("price_per_gib_month", "months"):
            _require(getattr(self, name) >= 0, f"storage.{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class EstimateConfig:
    """Everything `make estimate` needs; `jobs/estimate/sd2-base.yaml` documents the defaults' sources."""

    gpus: int = 128  # training GPU count
    gpu: GpuConfig = field(default_factory=GpuConfig)
    schedule: list[PhaseConfig] = field(default_factory=_sd2_schedule)
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    throughput_from: str = ""  # a `make bench` JSON (schema: module docstring); replaces throughput.per_gpu
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    pricing: PricingConfig = field(default_factory=PricingConfig)
    encode: EncodeCostConfig = field(default_factory=EncodeCostConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    sweep: list[int] = field(default_factory=lambda: list(DEFAULT_SWEEP))  # GPU counts for the plot
    out_dir: str = DEFAULT_OUT_DIR

    def __post_init__(self) -> None:
        _require(self.gpus >= 1, f"gpus must be >= 1, got {self.gpus}")
        _require(bool(self.schedule), "schedule is empty; list at least one {resolution, samples} phase")
        _require(all(n >= 1 for n in self.sweep), f"sweep GPU counts must be >= 1, got {self.sweep}")
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


# ------------------------------------------------------------------------------------- measured inputs


@dataclass(frozen=True)
class Measured:
    """The numbers the estimate runs on, after reading the bench JSON and encode manifest (if given)."""

    throughput: dict[int, float]  # training images/s per GPU by resolution, on `measured_on`
    measured_on: str
    reference_gpus: int
    encode_images_per_s_per_gpu: float
    bytes_per_sample: dict[int, float]
    kept_share: dict[int, float]  # share of read samples each resolution keeps (from a manifest; else {})
    notes: tuple[str, ...] = ()


def _read_json(uri: str, what: str, fix: str) -> dict[str, Any]:
    try:
        obj = storage.read_json(uri)
    except (OSError, ValueError) as err:
        raise EstimateError(f"cannot read {what} {uri!r}: {err}; {fix}") from err
    if not isinstance(obj, dict):
        raise EstimateError(f"{what} {uri!r} must hold a JSON object, not {type(obj).__name__}; {fix}")
    return obj


def _rate(entry: Any, where: str) -> float:
    value = entry.get("images_per_s_per_device") if isinstance(entry, dict) else None
    if not isinstance(value, (int, float)) or value <= 0:
        raise EstimateError(f"{where}: expected {{'images_per_s_per_device': <number > 0>}}, got {entry!r}")
    return float(value)


def _encode_rate(entry: Any, where: str) -> float:
    """One rate, or per-resolution rates whose per-image times add up (each sample is encoded at each)."""
    if isinstance(entry, dict) and "images_per_s_per_device" not in entry:
        seconds = sum(1.0 / _rate(v, f"{where}.{k}") for k, v in entry.items())
        return 1.0 / seconds if seconds else 0.0
    return _rate(entry, where)


def _resolution(key: Any, where: str) -> int:
    if not str(key).strip().isdigit():
        raise EstimateError(f'{where}: keys must be resolutions in px (e.g. "256"), got {key!r}')
    return int(key)


def read_bench(uri: str) -> dict[str, Any]:
    """Parse a `make bench` JSON into {train: {res: rate}, device, gpu_type, num_devices, encode}."""
    fix = "point throughput_from at the JSON `make bench` wrote (schema in train/estimate.py's docstring)"
    obj = _read_json(uri, "bench result", fix)
    train = obj.get("train")
    if not isinstance(train, dict) or not train:
        raise EstimateError(f"bench result {uri} has no `train` section keyed by resolution; {fix}")
    device = str(obj.get("device") or "")
    where = f"bench result {uri}"
    return {
        "train": {_resolution(r, where): _rate(e, f"{where}: train.{r}") for r, e in train.items()},
        "device": device,
        "gpu_type": gpu_type_for_device(device) if device else None,
        "num_devices": int(obj["num_devices"]) if obj.get("num_devices") else None,
        "encode": _encode_rate(obj["encode"], f"{where}: encode") if obj.get("encode") else None,
    }


def read_manifest_sizes(uri: str) -> tuple[dict[int, float], dict[int, float]]:
    """Bytes per sample and kept share per resolution from an encode manifest (root or manifest.json)."""
    path = uri if uri.endswith(".json") else storage.join(uri, MANIFEST_FILE)
    fix = "point storage.manifest at the output.uri of a finished `make encode` run (or its manifest.json)"
    obj = _read_json(path, "encode manifest", fix)
    resolutions, counts = obj.get("resolutions"), obj.get("num_samples") or {}
    if not isinstance(resolutions, dict) or not resolutions:
        raise EstimateError(f"encode manifest {path} has no `resolutions` section; {fix}")
    samples_read = obj.get("samples_read") or 0
    bytes_per_sample, kept = {}, {}
    for key, info in resolutions.items():
        res = _resolution(key, f"encode manifest {path}: resolutions")
        n = counts.get(str(key), info.get("num_samples", 0))
        if n > 0 and info.get("bytes", 0) > 0:
            bytes_per_sample[res] = info["bytes"] / n
            kept[res] = n / samples_read if samples_read > 0 else 1.0
    if not bytes_per_sample:
        raise EstimateError(f"encode manifest {path} holds no sized samples at any resolution; {fix}")
    return bytes_per_sample, kept


def resolve_inputs(cfg: EstimateConfig) -> Measured:
    """Config numbers, replaced by the bench JSON and encode manifest where those are given."""
    notes: list[str] = []
    throughput = {int(k): v for k, v in cfg.throughput.per_gpu.items()}
    measured_on, reference = cfg.measured_on, cfg.scaling.reference_gpus
    encode_rate = cfg.encode.images_per_s_per_gpu
    if cfg.throughput_from:
        bench = read_bench(cfg.throughput_from)
        throughput = bench["train"]
        measured_on = bench["gpu_type"] or measured_on
        reference = bench["num_devices"] or reference
        encode_rate = bench["encode"] or encode_rate
        notes.append(f"throughput from {cfg.throughput_from} ({bench['device'] or 'device not recorded'})")
        if bench["device"] and not bench["gpu_type"]:
            notes.append(f"WARNING: bench device {bench['device']!r} is unknown; taken as {measured_on}")
    bytes_per_sample = {int(k): v for k, v in cfg.storage.bytes_per_sample.items()}
    kept: dict[int, float] = {}
    if cfg.storage.manifest:
        bytes_per_sample, kept = read_manifest_sizes(cfg.storage.manifest)
        notes.append(f"bytes/sample from {cfg.storage.manifest}")
    _check_throughput_covers_schedule(cfg, throughput)
    _check_encode_rate(cfg, encode_rate)
    if measured_on != cfg.gpu.type:
        notes.append(_device_mismatch_note(cfg, measured_on))
    return Measured(throughput, measured_on, reference, encode_rate, bytes_per_sample, kept, tuple(notes))


def _check_throughput_covers_schedule(cfg: EstimateConfig, throughput: Mapping[int, float]) -> None:
    missing = sorted({p.resolution for p in cfg.schedule} - set(throughput))
    if missing:
        have = ", ".join(str(r) for r in sorted(throughput)) or "none"
        raise EstimateError(
            f"no training throughput for {', '.join(map(str, missing))} px (have: {have}); set "
            f"throughput.per_gpu.{missing[0]}=<images/s/GPU> or throughput_from=<make bench JSON>"
        )


def _check_encode_rate(cfg: EstimateConfig, rate: float) -> None:
    if cfg.encode.samples and rate <= 0:
        raise EstimateError(
            f"encode.samples={cfg.encode.samples} but no encode throughput; set "
            "encode.images_per_s_per_gpu=<images/s/GPU> (or encode.samples=0 to leave encode out)"
        )


def _device_mismatch_note(cfg: EstimateConfig, measured_on: str) -> str:
    if cfg.throughput.scale_by_peak_flops:
        ratio = GPU_TABLE[cfg.gpu.type].peak_bf16_tflops / GPU_TABLE[measured_on].peak_bf16_tflops
        return f"throughput measured on {measured_on}, scaled x{ratio:.2f} by peak bf16 TFLOP/s (optimistic)"
    return (
        f"WARNING: throughput measured on {measured_on} but planning {cfg.gpu.type}; run `make bench` on "
        f"{cfg.gpu.type} or set throughput.scale_by_peak_flops=true for an optimistic bound"
    )


# ------------------------------------------------------------------------------------------- estimate


def scaling_efficiency(scaling: ScalingConfig, gpus: int, resolution: int, reference_gpus: int) -> float:
    """Fraction of linear scaling kept at `gpus` (1 at or below the GPU count throughput was measured on)."""
    if gpus <= reference_gpus:
        return 1.0
    efficiency = scaling.efficiency_for(resolution)
    if scaling.model == "constant":
        return efficiency
    return efficiency ** math.log2(gpus / reference_gpus)


@dataclass(frozen=True)
class PhaseEstimate:
    name: str
    resolution: int
    samples: int
    images_per_s_per_gpu: float  # as measured (after any peak-FLOP/s scaling)
    scaling_efficiency: float
    cluster_images_per_s: float  # during training steps
    days: float  # wall clock, goodput included
    gpu_hours: float
    dollars: float


@dataclass(frozen=True)
class EncodeEstimate:
    samples: int
    gpus: int
    gpu_type: str
    images_per_s_per_gpu: float
    days: float
    gpu_hours: float
    dollars: float


@dataclass(frozen=True)
class StorageEstimate:
    samples: dict[int, int]
    bytes_per_sample: dict[int, float]
    gib: float
    dollars_per_month: float
    months: float
    dollars: float


@dataclass(frozen=True)
class Estimate:
    gpus: int
    gpu_type: str
    pricing_mode: str
    price_per_gpu_hour: float
    cluster_peak_bf16_pflops: float
    phases: tuple[PhaseEstimate, ...]
    encode: EncodeEstimate
    storage: StorageEstimate
    notes: tuple[str, ...] = ()

    @property
    def train_days(self) -> float:
        return sum(p.days for p in self.phases)

    @property
    def train_gpu_hours(self) -> float:
        return sum(p.gpu_hours for p in self.phases)

    @property
    def train_dollars(self) -> float:
        return sum(p.dollars for p in self.phases)

    @property
    def total_days(self) -> float:
        """Encode, then train (storage runs alongside)."""
        return self.encode.days + self.train_days

    @property
    def total_dollars(self) -> float:
        return self.train_dollars + self.encode.dollars + self.storage.dollars

    def summary(self) -> str:
        """One line for a launcher's dry run."""
        return (
            f"{self.gpus} x {self.gpu_type}: {self.train_days:.2f} days, "
            f"{self.train_gpu_hours:,.0f} GPU-hours, ${self.train_dollars:,.0f} to train "
            f"({self.pricing_mode} ${self.price_per_gpu_hour:.2f}/GPU-hour); "
            f"${self.total_dollars:,.0f} with encode and storage"
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            train_days=self.train_days,
            train_gpu_hours=self.train_gpu_hours,
            train_dollars=self.train_dollars,
            total_days=self.total_days,
            total_dollars=self.total_dollars,
        )
        return out


def _per_gpu_rate(cfg: EstimateConfig, measured: Measured, resolution: int) -> float:
    rate = measured.throughput[resolution]
    if cfg.throughput.scale_by_peak_flops and measured.measured_on != cfg.gpu.type:
        rate *= GPU_TABLE[cfg.gpu.type].peak_bf16_tflops / GPU_TABLE[measured.measured_on].peak_bf16_tflops
    return rate


def _phase_estimate(
    cfg: EstimateConfig, measured: Measured, phase: PhaseConfig, price: float
) -> PhaseEstimate:
    per_gpu = _per_gpu_rate(cfg, measured, phase.resolution)
    efficiency = scaling_efficiency(cfg.scaling, cfg.gpus, phase.resolution, measured.reference_gpus)
    cluster = per_gpu * cfg.gpus * efficiency
    wall_hours = phase.samples / cluster / SECONDS_PER_HOUR / cfg.scaling.goodput
    gpu_hours = wall_hours * cfg.gpus
    return PhaseEstimate(
        name=phase.name,
        resolution=phase.resolution,
        samples=phase.samples,
        images_per_s_per_gpu=per_gpu,
        scaling_efficiency=efficiency,
        cluster_images_per_s=cluster,
        days=wall_hours / HOURS_PER_DAY,
        gpu_hours=gpu_hours,
        dollars=gpu_hours * price,
    )


def _encode_estimate(cfg: EstimateConfig, measured: Measured) -> EncodeEstimate:
    enc, rate = cfg.encode, measured.encode_images_per_s_per_gpu
    gpu_hours = enc.samples / rate / SECONDS_PER_HOUR if enc.samples else 0.0
    price = enc.price_per_gpu_hour
    if price is None:
        price = cfg.pricing.per_gpu_hour(cfg.encode_gpu_type)
    return EncodeEstimate(
        samples=enc.samples,
        gpus=enc.gpus,
        gpu_type=cfg.encode_gpu_type,
        images_per_s_per_gpu=rate,
        days=gpu_hours / enc.gpus / HOURS_PER_DAY,
        gpu_hours=gpu_hours,
        dollars=gpu_hours * price,
    )


def _stored_samples(cfg: EstimateConfig, measured: Measured) -> dict[int, int]:
    if cfg.storage.samples:
        return {int(k): v for k, v in cfg.storage.samples.items()}
    return {
        res: round(cfg.encode.samples * measured.kept_share.get(res, 1.0))
        for res in measured.bytes_per_sample
    }


def _storage_estimate(cfg: EstimateConfig, measured: Measured) -> StorageEstimate:
    samples = _stored_samples(cfg, measured)
    missing = sorted(set(samples) - set(measured.bytes_per_sample))
    if missing:
        raise EstimateError(
            f"storage.samples lists {missing[0]} px but no bytes per sample for it; set "
            f"storage.bytes_per_sample.{missing[0]}=<bytes> or storage.manifest=<encode output>"
        )
    gib = sum(n * measured.bytes_per_sample[res] for res, n in samples.items()) / BYTES_PER_GIB
    per_month = gib * cfg.storage.price_per_gib_month
    return StorageEstimate(
        samples=samples,
        bytes_per_sample=dict(measured.bytes_per_sample),
        gib=gib,
        dollars_per_month=per_month,
        months=cfg.storage.months,
        dollars=per_month * cfg.storage.months,
    )


def _estimate_from(cfg: EstimateConfig, measured: Measured) -> Estimate:
    price = cfg.pricing.per_gpu_hour(cfg.gpu.type)
    return Estimate(
        gpus=cfg.gpus,
        gpu_type=cfg.gpu.type,
        pricing_mode=cfg.pricing.mode,
        price_per_gpu_hour=price,
        cluster_peak_bf16_pflops=cfg.gpus * GPU_TABLE[cfg.gpu.type].peak_bf16_tflops / 1000,
        phases=tuple(_phase_estimate(cfg, measured, phase, price) for phase in cfg.schedule),
        encode=_encode_estimate(cfg, measured),
        storage=_storage_estimate(cfg, measured),
        notes=measured.notes,
    )


def estimate(cfg: EstimateConfig) -> Estimate:
    """Days, GPU-hours and dollars for `cfg` (reads the bench JSON / manifest it names; writes nothing)."""
    return _estimate_from(cfg, resolve_inputs(cfg))


def sweep_gpu_counts(cfg: EstimateConfig, counts: Sequence[int] | None = None) -> list[Estimate]:
    """The same plan at each GPU count (default: cfg.sweep = 8, 16, ..., 512)."""
    measured = resolve_inputs(cfg)
    return [_estimate_from(dataclasses.replace(cfg, gpus=n), measured) for n in (counts or cfg.sweep)]


def estimate_for_plan(
    gpus: int, gpu_type: str, config: str | Path = DEFAULT_CONFIG, overrides: Sequence[str] = ()
) -> Estimate:
    """For a launcher's dry run: the named plan at this GPU count and type (`est.summary()` prints it)."""
    cfg = load_estimate_config(config, [*overrides, f"gpus={gpus}", f"gpu.type={gpu_type}"])
    return estimate(cfg)


# -------------------------------------------------------------------------------------------- outputs


def _align(rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in pairs]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


TABLE_COLUMNS = ("res", "samples", "img/s/GPU", "scaling", "cluster img/s", "days", "GPU-hours", "USD")


def _row(label: str, **cells: str) -> list[str]:
    """A table row: `label`, then each column's cell by its TABLE_COLUMNS name (spaces/slashes -> _)."""
    keys = [c.replace(" ", "_").replace("/", "_").replace("-", "_").lower() for c in TABLE_COLUMNS]
    return [label, *(cells.get(k, "") for k in keys)]


def _table_rows(est: Estimate) -> list[list[str]]:
    rows = [["", *TABLE_COLUMNS]]
    for p in est.phases:
        rows.append(
            _row(
                p.name,
                res=str(p.resolution),
                samples=f"{p.samples:,}",
                img_s_gpu=f"{p.images_per_s_per_gpu:,.2f}",
                scaling=f"{p.scaling_efficiency:.3f}",
                cluster_img_s=f"{p.cluster_images_per_s:,.0f}",
                days=f"{p.days:,.2f}",
                gpu_hours=f"{p.gpu_hours:,.0f}",
                usd=f"${p.dollars:,.0f}",
            )
        )
    train = {"days": f"{est.train_days:,.2f}", "gpu_hours": f"{est.train_gpu_hours:,.0f}"}
    rows.append(_row("train total", **train, usd=f"${est.train_dollars:,.0f}"))
    enc, st = est.encode, est.storage
    rows.append(
        _row(
            f"encode ({enc.gpus} x {enc.gpu_type}, once)",
            samples=f"{enc.samples:,}",
            img_s_gpu=f"{enc.images_per_s_per_gpu:,.2f}",
            days=f"{enc.days:,.2f}",
            gpu_hours=f"{enc.gpu_hours:,.0f}",
            usd=f"${enc.dollars:,.0f}",
        )
    )
    rows.append(_row(f"storage ({st.gib / 1024:,.1f} TiB x {st.months:g} months)", usd=f"${st.dollars:,.0f}"))
    rows.append(_row("total", days=f"{est.total_days:,.2f}", usd=f"${est.total_dollars:,.0f}"))
    return rows


def render_table(est: Estimate) -> str:
    """The plain-text table `make estimate` prints."""
    head = (
        f"{est.gpus} x {est.gpu_type} ({est.cluster_peak_bf16_pflops:,.1f} PFLOP/s peak bf16), "
        f"{est.pricing_mode.replace('_', '-')} ${est.price_per_gpu_hour:.3f}/GPU-hour"
    )
    notes = "".join(f"\nnote: {n}" for n in est.notes)
    return f"{head}\n{_align(_table_rows(est))}{notes}"


def render_markdown(est: Estimate, sweep: Sequence[Estimate]) -> str:
    """The estimate as markdown tables: the plan, then days and dollars at each swept GPU count."""
    rows = _table_rows(est)
    plan = ["| " + " | ".join(r) + " |" for r in rows[:1]]
    plan.append("|" + "---|" * len(rows[0]))
    plan += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    sweep_md = ["| GPUs | train days | GPU-hours | train USD | total USD |", "|---:|---:|---:|---:|---:|"]
    sweep_md += [
        f"| {s.gpus} | {s.train_days:,.2f} | {s.train_gpu_hours:,.0f} | ${s.train_dollars:,.0f} | "
        f"${s.total_dollars:,.0f} |"
        for s in sweep
    ]
    notes = "".join(f"\n- {n}" for n in est.notes)
    price = f"{est.pricing_mode} ${est.price_per_gpu_hour:.3f}/GPU-hour"
    title = f"# Training estimate: {est.gpus} x {est.gpu_type}, {price}"
    return f"{title}\n\n" + "\n".join(plan) + "\n\n## By GPU count\n\n" + "\n".join(sweep_md) + f"\n{notes}\n"


def plot_sweep(sweep: Sequence[Estimate], path: Path) -> Path:
    """Days and dollars vs GPU count (log2 x axis), one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters or CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter, NullLocator

    gpus = [s.gpus for s in sweep]
    days = [s.train_days for s in sweep]
    fig, (ax_days, ax_cost) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_days.plot(gpus, days, marker="o")
    for n, d in zip(gpus, days, strict=True):
        ax_days.annotate(f"{d:.3g}", (n, d), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax_days.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="training days", title="Wall-clock days")
    ax_days.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_days.yaxis.set_minor_formatter(NullFormatter())  # the points carry their own labels
    ax_cost.plot(gpus, [s.train_dollars / 1000 for s in sweep], marker="o", label="train")
    ax_cost.plot(gpus, [s.total_dollars / 1000 for s in sweep], marker="s", label="train + encode + storage")
    ax_cost.set(xscale="log", xlabel="GPUs", ylabel="thousand USD", title="Cost")
    ax_cost.set_ylim(bottom=0)
    ax_cost.legend()
    for ax in (ax_days, ax_cost):
        ax.set_xticks(gpus, [str(n) for n in gpus])
        ax.xaxis.set_minor_locator(NullLocator())  # log-scale minor ticks would relabel 2^k counts
        ax.grid(alpha=0.3)
    mode = sweep[0].pricing_mode.replace("_", "-")
    fig.suptitle(f"{sweep[0].gpu_type}, {mode} ${sweep[0].price_per_gpu_hour:.2f}/GPU-hour")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(est: Estimate, sweep: Sequence[Estimate], out_dir: str | Path) -> dict[str, Path]:
    """estimate.json (plan + sweep), estimate.md and estimate.png under out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "estimate.json", "md": out / "estimate.md", "png": out / "estimate.png"}
    payload = {"estimate": est.to_json(), "sweep": [s.to_json() for s in sweep]}
    paths["json"].write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    paths["md"].write_text(render_markdown(est, sweep))
    plot_sweep(sweep, paths["png"])
    return paths


# ------------------------------------------------------------------------------------------------ CLI


def estimate_command(
    config: str = typer.Argument(DEFAULT_CONFIG, help="jobs/estimate/<name>.yaml or a path to a YAML"),
    overrides: list[str] | None = typer.Argument(
        None, help="key=value, e.g. gpus=256 gpu.type=H100 pricing.mode=reserved throughput_from=bench.json"
    ),
) -> None:
    """Turn measured throughput into days, GPU-hours and dollars; write JSON, markdown and a plot."""
    overrides = list(overrides or [])
    if "=" in config and not Path(config).exists():  # `estimate gpus=256`: overrides, default config
        config, overrides = DEFAULT_CONFIG, [config, *overrides]
    try:
        cfg = load_estimate_config(config, overrides)
        est, sweep = estimate(cfg), sweep_gpu_counts(cfg)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(render_table(est))
    paths = write_outputs(est, sweep, cfg.out_dir)
    paths["config"] = Path(cfg.out_dir) / "config.json"  # the resolved inputs, next to the numbers
    paths["config"].write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    typer.echo("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":  # `python -m train.estimate [CONFIG] [key=value ...]`: no train CLI imports
    typer.run(estimate_command)
