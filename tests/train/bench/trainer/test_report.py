"""The trainer section's findings for the recipe as a run trains it, on a GPU's numbers (no GPU needed)."""

from __future__ import annotations

from train.bench.trainer.report import as_recipe_finding, trainer_rows

# what trainer.as_recipe returns for sd2-base-256 on one GPU (illustrative numbers, not measured)
AS_RUN = {
    "resolution": 256,
    "batch_size": 8,
    "fsdp": True,
    "fsdp_sharding_strategy": "SHARD_GRAD_OP",
    "compiled": True,
    "channels_last": True,
    "conv_weights_channels_last": False,
    "first_batch_s": 212.0,
    "per_batch_s": 0.025,
    "images_per_s_per_device": 320.0,
    "mfu": 0.174,
    "composer_outside_share": 0.04,
}
STEP = {"images_per_s_per_device": 585.0, "batch_size": 128}


def test_a_recipe_run_far_below_the_step_section_is_flagged_with_its_layout() -> None:
    line = as_recipe_finding("sd2-base-256", AS_RUN, STEP)
    assert line.startswith("sd2-base-256 as a run of it trains at 256 px (FSDP SHARD_GRAD_OP per block, NHWC")
    assert "FSDP SHARD_GRAD_OP per block, NHWC, conv kernels NCHW: each convolution copies its kernel" in line
    assert "microbatch 8, compiled; one device, no communication): 320.0 img/s, 17.4% MFU" in line
    assert "0.55x the step section's 585.0 img/s at batch 128 - a run of this recipe does not get" in line


def test_a_recipe_run_close_to_the_step_section_is_not_flagged() -> None:
    close = AS_RUN | {"images_per_s_per_device": 560.0, "conv_weights_channels_last": True, "fsdp": False}
    line = as_recipe_finding("sd2-base-256", close, STEP)
    assert "no FSDP, NHWC, microbatch 8" in line and "0.96x" in line and " - " not in line


def test_the_table_row_names_the_recipe_and_its_step_section_peer() -> None:
    trainer = {
        "resolution": 256, "recipe": "sd2-base-256", "wall_per_batch_s": 0.22, "in_step_s": 0.21,
        "bare_step_s": 0.21, "as_recipe": {"256": AS_RUN},
    }  # fmt: skip
    rows = trainer_rows(trainer, {"256": STEP})
    assert rows[-1][1:] == ["320.0 img/s, 17.4% MFU", "step section 585.0 img/s at batch 128"]
    assert rows[-1][0].startswith("sd2-base-256 as run, 256 px (FSDP SHARD_GRAD_OP per block, NHWC")


def test_the_recipe_as_run_says_how_busy_its_device_was() -> None:
    """As measured on an H200 (sixth run): 27.0 img/s at 256 px, 8 per GPU; its profile adds busy share."""
    measured = AS_RUN | {"first_batch_s": 16.2, "images_per_s_per_device": 27.0, "mfu": 0.0147}
    line = as_recipe_finding("sd2-base-256", measured | {"profile": {"device_busy_share": 0.12}}, STEP)
    assert "27.0 img/s, 1.5% MFU, first batch 16.2 s; device busy 12% of its bare step; 0.05x" in line
    assert "device busy" not in as_recipe_finding("sd2-base-256", measured | {"profile": {}}, STEP)
