"""shared/estimate/memory.py: the batch per GPU from its memory (issue 30)."""

from __future__ import annotations

import json

import pytest

from shared.config import ConfigError
from shared.estimate import GPU_TABLE, estimate, estimate_for_plan, load_estimate_config
from shared.estimate.memory import (
    ACTIVATION_BYTES_PER_IMAGE,
    MemoryCheck,
    batch_that_fits,
    memory_check,
    resident_bytes,
)
from shared.estimate.report import render_markdown, render_table

SD2_PARAMS = 865_910_724
# jobs/train/sd2-base-256.yaml: 0.29 GB of activations per image at 256 px under bf16 autocast.
SD2_256_ACTIVATIONS = 0.29e9


def test_every_gpu_type_has_its_memory() -> None:
    assert {name: spec.memory_gb for name, spec in GPU_TABLE.items()} == {
        "A100-40GB": 40.0, "A100-80GB": 80.0, "H100": 80.0, "H200": 141.0,
    }  # fmt: skip


def test_resident_bytes_per_strategy() -> None:
    assert resident_bytes(SD2_PARAMS) == pytest.approx(17.3e9, rel=2e-3)  # the recipe's 17.3 GB
    assert resident_bytes(SD2_PARAMS, 256, "SHARD_GRAD_OP") == pytest.approx(
        20 / 256 * SD2_PARAMS + 2 * SD2_PARAMS
    )
    assert resident_bytes(SD2_PARAMS, 256, "FULL_SHARD") == pytest.approx(20 / 256 * SD2_PARAMS)
    assert resident_bytes(SD2_PARAMS, 256, "DDP") == resident_bytes(SD2_PARAMS)


def test_sd2_at_256_px_fits_far_more_than_the_shipped_8_per_gpu() -> None:
    one = batch_that_fits(GPU_TABLE["H100"].memory_gb, SD2_256_ACTIVATIONS, SD2_PARAMS)
    assert one.max_images == int((0.85 * 80e9 - 17.3e9) // 0.29e9) == 174 and one.power_of_two == 128
    sharded = batch_that_fits(
        GPU_TABLE["H200"].memory_gb, SD2_256_ACTIVATIONS, SD2_PARAMS, 256, "SHARD_GRAD_OP"
    )
    assert sharded.power_of_two == 256
    assert batch_that_fits(1.0, SD2_256_ACTIVATIONS, SD2_PARAMS).max_images == 0  # nothing fits: 0, not < 0
    with pytest.raises(ValueError, match="> 0"):
        batch_that_fits(80.0, 0.0, SD2_PARAMS)


def test_measured_table_holds_the_shipped_recipes() -> None:
    """Measured on a CPU with CUDA's bf16 autocast policy (python -m train.bench.anatomy.memory)."""
    assert ACTIVATION_BYTES_PER_IMAGE[("sd2-base", 256)] == pytest.approx(0.242e9, rel=1e-3)
    assert ACTIVATION_BYTES_PER_IMAGE[("sd2-base", 512)] == pytest.approx(0.941e9, rel=1e-3)


def test_estimate_prints_the_recipes_batch_next_to_what_fits() -> None:
    est = estimate_for_plan(256, "H100")
    lines = [line for line in render_table(est).splitlines() if line.startswith("memory: ")]
    assert len(lines) == 2 and lines[0].startswith("memory: 256 px on H100: 8 per GPU uses 3.7 GB of 80 GB")
    assert "up to 273 fit (256 as a power of two)" in lines[0]
    assert lines[0].endswith(
        "most of it unused: up to 256 per GPU fit; this global batch on 8 GPUs, or global_batch_size=65536 "
        "with device_microbatch_size=256 (a new recipe: retune the learning rate)"
    )
    assert lines[1].startswith("memory: 512 px on H100: 8 per GPU uses 9.3 GB of 80 GB")
    assert "## Batch per GPU" in render_markdown(est, [est])


def test_estimate_json_carries_the_memory_check() -> None:
    payload = json.loads(json.dumps(estimate_for_plan(128, "A100-40GB").to_json()))
    first = payload["memory"][0]
    assert {k: first[k] for k in ("gpu_type", "resolution", "microbatch", "world_size", "fits")} == {
        "gpu_type": "A100-40GB", "resolution": 256, "microbatch": 8, "world_size": 128, "fits": True,
    }  # fmt: skip
    assert first["fit"]["max_images"] == 132 and first["mostly_unused"] is True
    # 16 per rank (2048 / 128) as 2 microbatches of 8: one microbatch of 16 fits
    assert first["line"].endswith(
        "set device_microbatch_size=16 (fewer accumulation steps, same global batch); more per GPU needs a "
        "larger global_batch_size or fewer GPUs"
    )


def test_a_microbatch_that_does_not_fit_names_one_that_does() -> None:
    check = memory_check("A100-40GB", "sd2-base", 512, 64, 1, "DDP", 2048)
    assert isinstance(check, MemoryCheck) and not check.fits and check.fit.max_images == 17
    assert (
        check.advice() == "does NOT fit: set device_microbatch_size=16 (accumulation keeps the global batch)"
    )
    full = memory_check("A100-40GB", "sd2-base", 256, 64, 8, "SHARD_GRAD_OP", 2048)
    assert isinstance(full, MemoryCheck) and full.advice() == "fits"  # 128 would not fit; 64 divides 256
    missing = memory_check("H100", "sd2-base", 768, 8)
    assert isinstance(missing, str) and missing.startswith(
        "no measured activation bytes for sd2-base at 768 px"
    )


def test_memory_section_checks_its_values() -> None:
    with pytest.raises(ConfigError, match=r"memory\.preset"):
        load_estimate_config("sd2-base", ["memory.preset=sd3"])
    cfg = load_estimate_config("sd2-base", ["memory.microbatch={256: 64}", "gpus=8", "gpu.type=A100-40GB"])
    (only,) = estimate(cfg).memory  # 512 px has no microbatch given: not checked
    assert isinstance(only, MemoryCheck) and only.microbatch == 64
