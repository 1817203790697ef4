"""The tiny preset's shipped VAE (shared/assets, trained by `python -m train tiny-vae`): it loads through
`shared.models.build_vae`, reconstructs sample images it never saw with their colours intact, gives latents
near unit scale after the preset's scaling factor, matches its JSON record, and its training entry point
still runs (so `make tiny-vae` cannot rot)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.models import build_vae
from shared.presets import ASSETS, get_preset
from train.tools import tiny_vae
from train.tools.cli import TINY_VAE_PER_SHARD, TINY_VAE_STEPS, tiny_vae_command

FRESH_SEED = 4242  # neither a training seed nor the held-out seed the JSON's PSNR was measured on
FRESH_PER_SHARD = 12
# The shipped model measures ~PSNR_SHIPPED dB on fresh images; a random-init VAE ~RANDOM dB (it outputs
# near-constant grey). The bar sits well below the first and far above the second, so it fails when the
# weights are missing, not loaded, or swapped for another model's, not when a retrain lands a dB lower.
MIN_PSNR_DB = 20.0
MIN_GAIN_OVER_RANDOM_DB = 8.0
# Mean colour per channel, uint8 levels: the shape/background colours are 50-200 levels apart, so a
# 10-level drift is invisible while a wrong colour is far outside it.
MAX_MEAN_COLOUR_ERROR = 10.0
SCALED_STD_RANGE = (0.7, 1.4)


@pytest.fixture(scope="module")
def fresh_images() -> tiny_vae.ImageSets:
    return tiny_vae.sample_images(FRESH_SEED, shards=1, per_shard=FRESH_PER_SHARD)


@pytest.fixture(scope="module")
def shipped_vae() -> Any:
    return build_vae(get_preset("tiny"))


@pytest.fixture(scope="module")
def reconstructions(shipped_vae: Any, fresh_images: tiny_vae.ImageSets) -> dict[int, torch.Tensor]:
    return {res: tiny_vae.reconstruct(shipped_vae, imgs) for res, imgs in fresh_images.by_resolution.items()}


def test_tiny_preset_points_at_the_shipped_weights() -> None:
    preset = get_preset("tiny")
    info = json.loads((ASSETS / tiny_vae.INFO_NAME).read_text())
    assert Path(preset.vae_weights) == ASSETS / tiny_vae.WEIGHTS_NAME
    assert preset.scale_factor == pytest.approx(info["scaling_factor"])
    assert preset.vae_downsample == 8 and preset.latent_channels == 4


def test_json_records_the_sha256_of_the_weights_file() -> None:
    info = json.loads((ASSETS / tiny_vae.INFO_NAME).read_text())
    weights = ASSETS / tiny_vae.WEIGHTS_NAME
    assert tiny_vae.sha256_of(weights) == info["sha256"]
    assert weights.stat().st_size <= 4 << 20


def test_shipped_weights_load_as_fp32_eval_model(shipped_vae: Any) -> None:
    assert not shipped_vae.training
    assert {p.dtype for p in shipped_vae.parameters()} == {torch.float32}
    assert shipped_vae.config.scaling_factor == pytest.approx(get_preset("tiny").scale_factor)


def test_reconstructs_unseen_samples_far_better_than_random_init(
    fresh_images: tiny_vae.ImageSets, reconstructions: dict[int, torch.Tensor]
) -> None:
    untrained = tiny_vae.build_untrained_vae(seed=0).eval()
    for res, images in fresh_images.by_resolution.items():
        shipped = tiny_vae.psnr(images, reconstructions[res])
        random = tiny_vae.psnr(images, tiny_vae.reconstruct(untrained, images))
        assert shipped > MIN_PSNR_DB, f"{res} px: {shipped:.1f} dB"
        assert shipped > random + MIN_GAIN_OVER_RANDOM_DB, (
            f"{res} px: {shipped:.1f} vs random {random:.1f} dB"
        )


def test_reconstruction_keeps_each_image_mean_colour(
    fresh_images: tiny_vae.ImageSets, reconstructions: dict[int, torch.Tensor]
) -> None:
    for res, images in fresh_images.by_resolution.items():
        original = images.float().mean(dim=(2, 3))
        recon = reconstructions[res].float().mean(dim=(2, 3))
        worst = float((original - recon).abs().max())
        assert worst < MAX_MEAN_COLOUR_ERROR, f"{res} px: a channel mean is off by {worst:.1f} levels"


def test_scaled_latents_of_the_sample_set_are_near_unit_std(shipped_vae: Any) -> None:
    sample = tiny_vae.sample_images(0, shards=1, per_shard=24)  # the start of the bundled sample data
    scale = get_preset("tiny").scale_factor
    for res, images in sample.by_resolution.items():
        std = float(tiny_vae.sampled_latents(shipped_vae, images).std()) * scale
        assert SCALED_STD_RANGE[0] <= std <= SCALED_STD_RANGE[1], f"{res} px: scaled latent std {std:.2f}"


def test_training_entry_point_writes_loadable_weights(tmp_path: Path) -> None:
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file

    info = tiny_vae_command(out=tmp_path, steps=2, per_shard=2)
    weights = tmp_path / tiny_vae.WEIGHTS_NAME
    recorded = json.loads((tmp_path / tiny_vae.INFO_NAME).read_text())
    assert recorded == info and recorded["steps"] == 2
    assert recorded["sha256"] == tiny_vae.sha256_of(weights)
    assert recorded["scaling_factor"] > 0
    AutoencoderKL(**get_preset("tiny").vae).load_state_dict(load_file(weights))


def test_command_defaults_match_the_training_run() -> None:
    """train/tools/cli.py repeats the run's defaults so `--help` needs no torch: they must agree."""
    assert (TINY_VAE_STEPS, TINY_VAE_PER_SHARD) == (tiny_vae.DEFAULT_STEPS, tiny_vae.PER_SHARD)
