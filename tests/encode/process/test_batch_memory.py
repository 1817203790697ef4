"""Issue 22 (5), issue 30: `encoder.batch_size: 0` sizes the batch from one image's bytes, measured through
the real encode call on the device it runs on (encode/process/memory.py says why not computed on the
host); the GPU list checks the A100's batch on a GPU (tests/encode/test_gpu_encode.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from encode.config import EncodeConfig
from encode.process.encoders import largest_image_size, load_encoders
from encode.process.memory import (
    A100_40GB_USABLE,
    AUTO_BATCH_CAP,
    BATCH_HEADROOM,
    CPU_AUTO_BATCH,
    auto_batch,
    largest_batch,
    measured_bytes_per_image,
    peak_tensor_bytes,
    text_tower_params,
)
from shared.config import load_config
from shared.presets import SD2_TEXT

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


CPU = ["source.uri=unused", "output.uri=unused", "encoder.device=cpu"]
# SD2-base's VAE encoder at 512 px, fp16, channels_last, fp32 GroupNorm (the recipe's), as the GPU list
# measured it on an H200: 51.4 GiB allocated at batch 88, 1.75 GB of it the two models' weights.
H200_MEASURED_PER_IMAGE = (51.37 * 2**30 - 1.75e9) / 88


def test_one_images_bytes_are_measured_through_the_real_encode_call() -> None:
    encoders = load_encoders(load_config(EncodeConfig, "sample", CPU, kind="datasets"))

    def per_image(side: int) -> float:
        blank = np.zeros((side, side, 3), dtype=np.uint8)
        return measured_bytes_per_image(lambda n: encoders.encode_images([blank] * n), encoders.device)

    small, large = per_image(64), per_image(128)
    assert small > 64 * 64 * 3 * 4  # at least the image itself in fp32
    assert large == pytest.approx(4 * small, rel=0.1)  # activations grow with the pixels


def test_laion_recipe_batch_from_the_measured_bytes() -> None:
    cfg = load_config(EncodeConfig, "laion400m", [], kind="datasets")
    assert cfg.transform.resolutions[-1] == 512 and cfg.encoder.batch_size == 0  # sized on the GPU it runs on
    fixed = 1.75e9  # SD2's VAE (335 MB) and text tower (1.4 GB) in fp32 beside the batch
    assert 4 * text_tower_params(SD2_TEXT) < fixed
    # the numbers the docs quote: a 40 GB A100, an 80 GB H100, an H200 as torch reports them
    per_image = H200_MEASURED_PER_IMAGE
    cards = (A100_40GB_USABLE, 79.2 * 2**30, 139.8 * 2**30)
    batches = [auto_batch(per_image, fixed, usable) for usable in cards]
    assert batches == [48, 96, 176]
    assert largest_batch(per_image, fixed) < 88  # what the host-side count once sized: out of memory


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
    overrides = [*CPU, "encoder.batch_size=0"]
    encoders = load_encoders(load_config(EncodeConfig, "sample", overrides, kind="datasets"))
    assert encoders.batch_size == CPU_AUTO_BATCH
    square = load_config(EncodeConfig, "sample", overrides, kind="datasets")
    side = max(square.transform.resolutions)
    assert largest_image_size(square) == (side, side)
    bucketed = load_config(EncodeConfig, "sample-buckets", overrides, kind="datasets")
    lists = bucketed.transform.bucket_lists(bucketed.filter.max_aspect_ratio)
    height, width = largest_image_size(bucketed)
    assert height * width == max(h * w for buckets in lists.values() for h, w in buckets)


def test_a_batch_out_of_gpu_memory_is_encoded_in_halves(caplog: pytest.LogCaptureFixture) -> None:
    encoders = load_encoders(load_config(EncodeConfig, "sample", CPU, kind="datasets"))
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(5)]
    whole = encoders.encode_images(images)
    encode = encoders.vae.encode

    def fits_two(pixels: torch.Tensor) -> object:  # a GPU with room for two images at a time
        if len(pixels) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return encode(pixels)

    encoders.vae.encode = fits_two
    with caplog.at_level("WARNING", logger="encode"):
        halves = encoders.encode_images(images)
        encoders.encode_images(images)
    for got, want in zip(halves, whole, strict=True):  # 5 -> 2 + 3 -> 2 + (1 + 2)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # per-batch kernels
    assert encoders.halved_batches == 4
    warnings = [r.getMessage() for r in caplog.records if "out of GPU memory" in r.getMessage()]
    assert len(warnings) == 1 and "encoder.batch_size" in warnings[0]
