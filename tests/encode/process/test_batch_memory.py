"""Issue 22 (5): the shipped encode recipe's batch fits a 40 GB A100 at 512 px, derived from the computed peak
memory of SD2-base's VAE encoder (random init, SD2's shapes; encode/process/memory.py says how)."""

from __future__ import annotations

import pytest
import torch

from encode.config import EncodeConfig
from encode.process.memory import (
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
    per_image = vae_encode_peak_per_image(vae, 512)
    assert per_image == pytest.approx(540 * MIB, rel=0.05)  # the number the docs quote
    fixed = weights_bytes(vae) + 4 * text_tower_params(SD2_TEXT)  # both in fp32 beside the batch
    fits = largest_batch(per_image, fixed)
    cfg = load_config(EncodeConfig, "laion400m", [], kind="datasets")
    assert cfg.transform.resolutions[-1] == 512 and cfg.encoder.batch_size <= fits
    assert largest_batch(per_image, fixed) < 128  # the batch this recipe shipped with did not fit
