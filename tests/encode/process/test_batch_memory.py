"""Issue 22 (5): the shipped encode recipe's batch fits a 40 GB A100 at 512 px, derived from the computed peak
memory of SD2-base's VAE encoder (random init, SD2's shapes; encode/process/memory.py says how)."""

from __future__ import annotations

import pytest
import torch

from encode.config import EncodeConfig
from encode.process.encoders import largest_image_pixels, load_encoders
from encode.process.memory import (
    A100_40GB_USABLE,
    AUTO_BATCH_CAP,
    BATCH_HEADROOM,
    CPU_AUTO_BATCH,
    auto_batch,
    largest_batch,
    peak_tensor_bytes,
    text_tower_params,
    vae_encode_peak_per_image,
    weights_bytes,
)
from shared.config import load_config
from shared.presets import SD2_TEXT, SD2_VAE

MIB = 2**20


def test_peak_tracker_counts_live_outputs_and_frees() -> None:
    def two_alive_then_one() -> None:
        a = torch.ones(1024, 256)  # 1 MiB
        b = a * 2  # 2 MiB alive
        del a
        c = b + 1  # a freed: still 2 MiB at most
        del b, c

    assert peak_tensor_bytes(two_alive_then_one) == 2 * MIB


def test_sd2_text_tower_parameter_count() -> None:
    # OpenCLIP ViT-H/14's text tower (24 layers of width 1024): 354 M parameters
    assert text_tower_params(SD2_TEXT) == pytest.approx(354e6, rel=0.01)


@pytest.mark.slow  # SD2's VAE encoder at 128 px on CPU (~30 s on 2 loaded cores)
def test_laion_recipe_batch_fits_a_40gb_a100_at_512px() -> None:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(**SD2_VAE).eval()
    per_image = vae_encode_peak_per_image(vae, 512)  # its weights require grad: the count must not care
    assert per_image == pytest.approx(320 * MIB, rel=0.05)  # the number the docs quote
    assert vae_encode_peak_per_image(vae.requires_grad_(False), 512) == per_image
    fixed = weights_bytes(vae) + 4 * text_tower_params(SD2_TEXT)  # both in fp32 beside the batch
    fits = largest_batch(per_image, fixed)
    cfg = load_config(EncodeConfig, "laion400m", [], kind="datasets")
    assert cfg.transform.resolutions[-1] == 512 and cfg.encoder.batch_size == 0  # sized on the GPU it runs on
    assert auto_batch(per_image, fixed, A100_40GB_USABLE) == 88 <= fits  # the numbers the docs quote
    assert largest_batch(per_image, fixed) < 128  # the batch this recipe once shipped with does not fit


def test_auto_batch_stays_within_the_headroom_in_whole_tiles() -> None:
    per_image, fixed = 320 * MIB, 1.75e9
    for usable in (16 * 2**30, A100_40GB_USABLE, 79.2 * 2**30, 139.8 * 2**30):
        batch = auto_batch(per_image, fixed, usable)
        assert batch % 8 == 0 and batch * per_image + fixed <= BATCH_HEADROOM * usable, usable
        assert (batch + 8) * per_image + fixed > BATCH_HEADROOM * usable or batch == AUTO_BATCH_CAP
    assert auto_batch(per_image, fixed, 79.2 * 2**30) == 184  # an 80 GB H100 as torch reports it
    assert auto_batch(per_image, fixed, 1e12) == AUTO_BATCH_CAP
    assert auto_batch(per_image, fixed, 4 * 2**30) == 4  # under 8 images: no rounding to tiles
    assert auto_batch(per_image, fixed, 2e9) == 1  # never 0


def test_batch_size_0_runs_32_off_a_gpu_and_buckets_size_by_their_largest() -> None:
    overrides = ["source.uri=unused", "output.uri=unused", "encoder.batch_size=0", "encoder.device=cpu"]
    encoders = load_encoders(load_config(EncodeConfig, "sample", overrides, kind="datasets"))
    assert encoders.batch_size == CPU_AUTO_BATCH
    square = load_config(EncodeConfig, "sample", overrides, kind="datasets")
    assert largest_image_pixels(square) == max(square.transform.resolutions) ** 2
    bucketed = load_config(EncodeConfig, "sample-buckets", overrides, kind="datasets")
    lists = bucketed.transform.bucket_lists(bucketed.filter.max_aspect_ratio)
    assert largest_image_pixels(bucketed) == max(h * w for buckets in lists.values() for h, w in buckets)
