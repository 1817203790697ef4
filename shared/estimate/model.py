"""The cost model: schedule phases x scaling efficiency -> days, GPU-hours, dollars; encode and storage."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import ConfigError
from shared.estimate.cluster import host_bound_note
from shared.estimate.config import EstimateConfig, PhaseConfig, ScalingConfig, load_estimate_config
from shared.estimate.gpus import (
    BYTES_PER_GIB,
    DEFAULT_CONFIG,
    GPU_TABLE,
    HOURS_PER_DAY,
    SECONDS_PER_HOUR,
    EstimateError,
)
from shared.estimate.inputs import Measured, resolve_inputs
from shared.estimate.memory import MemoryCheck, ddp_alternative, memory_check
from shared.estimate.text_store import TextStoreComparison, compare_text_stores, manifest_store

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
    text_store: TextStoreComparison | None = None  # embeddings vs tokens (shared/estimate/text_store.py)
    memory: tuple[MemoryCheck | str, ...] = ()  # per phase: the recipe's batch vs gpu_type's memory

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
        if self.text_store is not None:
            out["text_store"] = self.text_store.to_json()
        out["memory"] = [m if isinstance(m, str) else m.to_json() for m in self.memory]
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
    phases = tuple(_phase_estimate(cfg, measured, phase, price) for phase in cfg.schedule)
    stored = _storage_estimate(cfg, measured)
    return Estimate(
        gpus=cfg.gpus,
        gpu_type=cfg.gpu.type,
        pricing_mode=cfg.pricing.mode,
        price_per_gpu_hour=price,
        cluster_peak_bf16_pflops=cfg.gpus * GPU_TABLE[cfg.gpu.type].peak_bf16_tflops / 1000,
        phases=phases,
        encode=_encode_estimate(cfg, measured),
        storage=stored,
        notes=measured.notes + _host_bound_notes(cfg, phases),
        text_store=_text_store(cfg, stored, phases),
        memory=_memory_checks(cfg),
    )


def _host_bound_notes(cfg: EstimateConfig, phases: tuple[PhaseEstimate, ...]) -> tuple[str, ...]:
    """Each phase whose rate would finish the recipe's microbatch (memory.microbatch) in less time than the
    host's work a step under per-block FSDP (shared/estimate/cluster.py `host_bound_note`)."""
    fsdp = cfg.memory.strategy != "DDP"
    notes = []
    for phase in phases:
        micro = cfg.memory.microbatch.get(str(phase.resolution))
        if not micro:
            continue
        ddp = ddp_alternative(cfg.gpu.type, cfg.memory.preset, phase.resolution, micro)
        if note := host_bound_note(fsdp, micro, phase.images_per_s_per_gpu, ddp):
            notes.append(f"{phase.name}: {note}")
    return tuple(notes)


def _memory_checks(cfg: EstimateConfig) -> tuple[MemoryCheck | str, ...]:
    """Each schedule resolution with a recipe microbatch (memory.microbatch), once, in schedule order."""
    mem, resolutions = cfg.memory, dict.fromkeys(p.resolution for p in cfg.schedule)
    return tuple(
        memory_check(cfg.gpu.type, mem.preset, res, micro, cfg.gpus, mem.strategy, mem.global_batch)
        for res in resolutions
        if (micro := mem.microbatch.get(str(res)))
    )


def _text_store(
    cfg: EstimateConfig, stored: StorageEstimate, phases: tuple[PhaseEstimate, ...]
) -> TextStoreComparison | None:
    """Both text.store modes priced, when every training resolution has a size (else left out)."""
    if not stored.samples or not {p.resolution for p in phases} <= set(stored.bytes_per_sample):
        return None
    return compare_text_stores(cfg, stored.samples, stored.bytes_per_sample, phases)


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


def dataset_text_store_line(
    gpus: int, gpu_type: str, data_uri: str, config: str | Path = DEFAULT_CONFIG
) -> str:
    """For a train dry run: embeddings vs tokens priced with the bytes per sample of the dataset it reads
    (when its manifest has the schedule's resolutions; else the plan's SD2-base sizes), and its mode."""
    try:
        sized_by, est = f"bytes/sample of {data_uri}", None
        if data_uri:
            try:
                est = estimate_for_plan(gpus, gpu_type, config, [f"storage.manifest={data_uri}"])
            except Exception:  # best effort (S3 errors are not all OSError): fall back to SD2 sizes
                est = None
        if est is None or est.text_store is None:
            sized_by, est = f"SD2-base bytes/sample ({config})", estimate_for_plan(gpus, gpu_type, config)
    except (ConfigError, OSError) as err:
        return f"text.store comparison unavailable ({err})"
    if est.text_store is None:
        return "text.store comparison unavailable (no bytes per sample for the schedule's resolutions)"
    store = (manifest_store(data_uri) if data_uri else None) or "unknown (no readable manifest)"
    # A choice for the dataset, not one run: its text tower is priced over the whole schedule of `config`.
    schedule = f"text tower over the full schedule of {config}, not this run's"
    return f"{est.text_store.line()} [{sized_by}; {schedule}; this dataset stores {store}]"
