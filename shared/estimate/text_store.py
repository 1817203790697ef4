"""text.store priced in dollars: stored embeddings vs token ids + the frozen text tower run in every step.

Per mode, for the configured schedule and the kept shards:

    bytes/sample(mode)  = bytes/sample as measured + text bytes(mode) - text bytes(measured mode)
                          text bytes: embeddings 77 x 1024 x 2 = 157,696 B, tokens 77 x 2 = 154 B (SD2)
    storage             = sum over resolutions of samples kept x bytes/sample(mode); $/month at the S3 price
    reads (during a phase) = cluster images/s x bytes/sample(mode), per GPU, per node and cluster-wide
    extra GPU-hours (tokens) = phase GPU-hours x (step-time ratio - 1)
                          ratio: `make bench`'s measured online/stored step time when throughput_from has it
                          (`text_store.<res>.ratio`), else the FLOP-ideal 1 + tower / U-Net step GFLOP
    cost(mode)          = storage $/month x months kept + extra compute $

Tokens win when the storage they save over the months kept outweighs the tower's compute; the break-even
is extra compute $ / storage $ saved per month. Pure Python, like the rest of the planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from shared import storage
from shared.estimate.config import TEXT_MODES, EstimateConfig, TextCostConfig
from shared.estimate.gpus import MANIFEST_FILE, EstimateError

BYTES_PER_TIB = 2**40
BYTES_PER_GIB = 2**30
BYTES_PER_GB = 1e9  # network rates in decimal units, as links and S3 limits are quoted
MODES = TEXT_MODES


class PhaseEstimate(Protocol):
    """What this module reads of a schedule phase's estimate (shared/estimate/model.py PhaseEstimate)."""

    resolution: int
    cluster_images_per_s: float
    gpu_hours: float
    dollars: float


@dataclass(frozen=True)
class ModeCost:
    """One text.store mode over the schedule and the months the shards are kept."""

    mode: str
    bytes_per_sample: dict[int, float]
    storage_tib: float
    text_share: float  # of the stored bytes
    storage_dollars_per_month: float
    read_mb_s_per_gpu: dict[int, float]  # by phase resolution, MB/s (decimal)
    read_mb_s_per_node: dict[int, float]
    read_gb_s_cluster: dict[int, float]
    extra_gpu_hours: float  # of the text tower in the step (0 for embeddings)
    extra_dollars: float

    def total(self, months: float) -> float:
        return self.storage_dollars_per_month * months + self.extra_dollars


@dataclass(frozen=True)
class TextStoreComparison:
    embeddings: ModeCost
    tokens: ModeCost
    months: float
    step_ratio: dict[int, float]  # tokens / embeddings step time, by resolution
    ratio_source: str  # "bench" or "FLOP-ideal"
    flop_ideal_ratio: dict[int, float]

    @property
    def cheaper(self) -> str:
        return (
            "tokens" if self.tokens.total(self.months) < self.embeddings.total(self.months) else "embeddings"
        )

    @property
    def break_even_months(self) -> float | None:
        """Months kept after which tokens cost less (None: they never do, storage is not cheaper)."""
        saved = self.embeddings.storage_dollars_per_month - self.tokens.storage_dollars_per_month
        extra = self.tokens.extra_dollars - self.embeddings.extra_dollars
        return extra / saved if saved > 0 else None

    def line(self) -> str:
        """One line for `make estimate` and a train dry run."""
        e, t = self.embeddings, self.tokens
        even = self.break_even_months
        even_text = f"break-even {even:.2f} months" if even is not None else "tokens never cheaper"
        return (
            f"text.store: embeddings {e.storage_tib:,.1f} TiB ${e.storage_dollars_per_month:,.0f}/month vs "
            f"tokens {t.storage_tib:,.1f} TiB ${t.storage_dollars_per_month:,.0f}/month "
            f"+ {t.extra_gpu_hours:,.0f} GPU-hours (${t.extra_dollars:,.0f}) of text tower; over "
            f"{self.months:g} months {self.cheaper} is cheaper (${e.total(self.months):,.0f} vs "
            f"${t.total(self.months):,.0f}; {even_text})"
        )

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {**asdict(self), "cheaper": self.cheaper, "break_even_months": self.break_even_months}


def flop_ideal_ratio(cfg: TextCostConfig, resolution: int) -> float:
    """Step time with the tower in it over without, if both ran at the same FLOP/s."""
    unet = cfg.unet_step_gflop.get(str(resolution))
    return 1.0 + cfg.tower_gflop_per_sample / unet if unet else 1.0


def bench_ratios(uri: str) -> dict[int, float]:
    """`text_store.<res>.ratio` of a `make bench` JSON ({} when it has none)."""
    try:
        obj = storage.read_json(uri)
    except (OSError, ValueError):
        return {}
    section = obj.get("text_store") if isinstance(obj, dict) else None
    out = {}
    for res, entry in (section or {}).items():
        ratio = entry.get("ratio") if isinstance(entry, dict) else None
        if str(res).isdigit() and isinstance(ratio, int | float) and ratio > 0:
            out[int(res)] = float(ratio)
    return out


def manifest_store(uri: str) -> str | None:
    """The text store an encode manifest records (None: unreadable, or written before the record)."""
    path = uri if uri.endswith(".json") else storage.join(uri, MANIFEST_FILE)
    try:
        obj = storage.read_json(path)
    except Exception:  # informational only; S3 client errors are not all OSError
        return None
    encoder = obj.get("encoder") if isinstance(obj, dict) else None
    store = encoder.get("text_store") if isinstance(encoder, dict) else None
    return store if store in MODES else "embeddings"


def _mode_cost(
    cfg: TextCostConfig,
    mode: str,
    measured: str,
    samples: dict[int, int],
    bytes_per_sample: dict[int, float],
    phases: tuple[PhaseEstimate, ...],
    gib_price: float,
    ratios: dict[int, float],
    gpus: int,
) -> ModeCost:
    delta = cfg.text_bytes(mode) - cfg.text_bytes(measured)
    per_sample = {res: b + delta for res, b in bytes_per_sample.items()}
    total = sum(n * per_sample[res] for res, n in samples.items())
    text = sum(n * cfg.text_bytes(mode) for n in samples.values())
    read_gpu, read_node, read_cluster = {}, {}, {}
    extra_hours = extra_dollars = 0.0
    for phase in phases:
        ratio = ratios[phase.resolution] if mode == "tokens" else 1.0
        rate = phase.cluster_images_per_s / ratio  # the tower slows the step: fewer images, fewer reads
        size = per_sample.get(phase.resolution, 0.0)
        read_cluster[phase.resolution] = rate * size / BYTES_PER_GB
        read_gpu[phase.resolution] = rate * size / gpus / 1e6
        read_node[phase.resolution] = read_gpu[phase.resolution] * min(cfg.gpus_per_node, gpus)
        hours = phase.gpu_hours * (ratio - 1.0)
        extra_hours += hours
        extra_dollars += hours * (phase.dollars / phase.gpu_hours if phase.gpu_hours else 0.0)
    return ModeCost(
        mode=mode,
        bytes_per_sample=per_sample,
        storage_tib=total / BYTES_PER_TIB,
        text_share=text / total if total else 0.0,
        storage_dollars_per_month=total / BYTES_PER_GIB * gib_price,
        read_mb_s_per_gpu=read_gpu,
        read_mb_s_per_node=read_node,
        read_gb_s_cluster=read_cluster,
        extra_gpu_hours=extra_hours,
        extra_dollars=extra_dollars,
    )


def compare_text_stores(
    cfg: EstimateConfig,
    samples: dict[int, int],
    bytes_per_sample: dict[int, float],
    phases: tuple[PhaseEstimate, ...],
) -> TextStoreComparison:
    """Both modes priced for this plan (bytes from the config or the manifest it names)."""
    text = cfg.text
    measured = (manifest_store(cfg.storage.manifest) if cfg.storage.manifest else None) or text.measured_store
    missing = sorted({p.resolution for p in phases} - set(bytes_per_sample))
    if missing:
        raise EstimateError(
            f"no bytes per sample for {missing[0]} px to price text.store; set "
            f"storage.bytes_per_sample.{missing[0]}=<bytes> or storage.manifest=<encode output>"
        )
    ideal = {p.resolution: flop_ideal_ratio(text, p.resolution) for p in phases}
    measured_ratios = bench_ratios(cfg.throughput_from) if cfg.throughput_from else {}
    ratios = {res: measured_ratios.get(res, ideal[res]) for res in ideal}
    source = "bench" if measured_ratios and set(ideal) <= set(measured_ratios) else "FLOP-ideal"
    price = cfg.storage.price_per_gib_month
    costs = {
        mode: _mode_cost(text, mode, measured, samples, bytes_per_sample, phases, price, ratios, cfg.gpus)
        for mode in MODES
    }
    return TextStoreComparison(
        costs["embeddings"], costs["tokens"], cfg.storage.months, ratios, source, ideal
    )
