"""shared/estimate/memory.py: the batch per GPU from its memory (issue 30)."""

from __future__ import annotations

import pytest

from shared.estimate import GPU_TABLE
from shared.estimate.memory import batch_that_fits, resident_bytes

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
