"""On a GPU: encode at 512 px with the shipped recipe's batch on a 40 GB A100 (jobs/datasets/laion400m.yaml's
`encoder.batch_size: 0`, sized as load_encoders sizes it: one image's bytes measured on this GPU) through
`Encoders.encode_images` (uint8 to the device, fp16 autocast, channels_last VAE), SD2-base's shapes with
random weights (no hub). Records the peak memory next to the measured bytes per image
(encode/process/memory.py) in $GPU_TESTS_OUT/encode-512-peak.json (default outputs/gpu-tests) and asserts
it fits a 40 GB A100.
And: queueing a batch's models (what encode.pipeline does a few batches ahead) never waits for the device."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from encode.config import EncodeConfig
from encode.process.encoders import Encoders, largest_image_size, speed_up_vae
from encode.process.memory import A100_40GB_USABLE, auto_batch, measured_bytes_per_image, weights_bytes
from encode.process.timing import MainThreadTimes
from shared.config import load_config
from shared.models import build_text_encoder, build_vae
from shared.presets import get_preset

pytestmark = pytest.mark.gpu

RESOLUTION = 512
GIB = 2**30


def test_encode_512px_at_the_recipe_batch_fits_a_40gb_a100(record_property: Any) -> None:
    cfg = load_config(EncodeConfig, "laion400m", [], kind="datasets")
    preset = dataclasses.replace(get_preset("sd2-base"), pretrained=None, vae_weights=None)  # random init
    device = torch.device("cuda")
    vae, text = build_vae(preset), build_text_encoder(preset)
    vae = vae.to(device).to(memory_format=torch.channels_last)
    speed_up_vae(vae, cfg.encoder.low_precision_norms, compile=False)
    text.to(device)
    encoders = Encoders(preset, vae, text, device, cfg.encoder.precision, ids=None)  # type: ignore[arg-type]
    # The recipe's batch_size 0 as load_encoders sizes it on a 40 GB A100, whatever GPU runs the test.
    size = largest_image_size(cfg)
    assert size == (RESOLUTION, RESOLUTION)
    blank = np.zeros((*size, 3), dtype=np.uint8)
    per_image = measured_bytes_per_image(lambda n: encoders.encode_images([blank] * n), device)
    batch = cfg.encoder.batch_size or auto_batch(per_image, weights_bytes(vae, text.model), A100_40GB_USABLE)
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, (RESOLUTION, RESOLUTION, 3), dtype=np.uint8) for _ in range(batch)]
    encoders.encode_text(["a photo of a cat"] * batch)
    encoders.encode_images(pixels)  # cuDNN's algorithm search and the allocator's first growth
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    mean, _ = encoders.encode_images(pixels)
    torch.cuda.synchronize()
    assert mean.shape == (batch, *preset.latent_shape(RESOLUTION))
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    result = {
        "device": torch.cuda.get_device_name(),
        "resolution": RESOLUTION,
        "batch": batch,
        "peak_allocated_gib": round(peak / GIB, 2),
        "peak_reserved_gib": round(reserved / GIB, 2),
        "measured_mib_per_image": round(per_image / 2**20, 1),
        "expected_activation_gib": round(batch * per_image / GIB, 2),
        "a100_40gb_usable_gib": round(A100_40GB_USABLE / GIB, 2),
    }
    out = Path(os.environ.get("GPU_TESTS_OUT", "outputs/gpu-tests"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "encode-512-peak.json").write_text(json.dumps(result, indent=2))
    for key, value in result.items():
        record_property(key, value)
    print(json.dumps(result))
    assert reserved < A100_40GB_USABLE, result


def test_queueing_a_batch_never_waits_for_the_device() -> None:
    """encode.pipeline queues a few batches ahead (launch_text, launch_images): neither may synchronize with
    the device, or the host would wait for every batch queued before it. The results equal a plain encode."""
    preset = get_preset("tiny")
    device = torch.device("cuda")
    vae = build_vae(preset).to(device).to(memory_format=torch.channels_last)
    text = build_text_encoder(preset)
    text.to(device)
    encoders = Encoders(preset, vae, text, device, "fp16", ids=None)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(8)]
    captions = ["a photo of a cat"] * 8
    expected_text, expected_mean = encoders.encode_text(captions), encoders.encode_images(pixels)[0]
    torch.cuda.synchronize()
    times, spans = MainThreadTimes(device), []  # the device timeline's marks may not wait either
    torch.cuda.set_sync_debug_mode("error")
    try:
        queued = []
        for _ in range(3):
            with times.on_device(spans):
                queued.append((encoders.launch_text(captions), encoders.launch_images(pixels)))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for text_out, images_out in queued:
        assert np.array_equal(text_out.arrays()[0], expected_text)
        assert np.array_equal(images_out.arrays()[0], expected_mean)
    times.device.account(spans)
    assert times.device.busy_s > 0 and times.device.idle_s >= 0
