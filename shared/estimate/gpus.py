"""The GPU table (peak bf16 TFLOP/s, list and reserved prices), the SD2 schedule and the planner's
constants and input checks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from shared.config import ConfigError

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
    memory_gb: float = 0.0  # device memory, GB (1e9 bytes), from the datasheet; sizes the batch per GPU
    # device memory bandwidth, TB/s, from the datasheet: prices the memory-bound state update per step
    # (shared/estimate/cluster.py `state_update`)
    memory_tb_s: float = 0.0


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
# Memory bandwidth: A100 datasheet (SXM) "GPU Memory Bandwidth 1,555GB/s" (40GB) and "2,039GB/s" (80GB); H100
# SXM datasheet "3.35TB/s"; H200 datasheet "4.8TB/s".
GPU_TABLE: dict[str, GpuSpec] = {
    "A100-40GB": GpuSpec("A100-40GB", 312.0, 4.10, 1.844, 40.0, 1.555),
    "A100-80GB": GpuSpec("A100-80GB", 312.0, 5.12, 2.31, 80.0, 2.039),
    "H100": GpuSpec("H100", 989.0, 12.29, 4.916, 80.0, 3.35),
    "H200": GpuSpec("H200", 989.0, 13.38, 5.408, 141.0, 4.8),
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
