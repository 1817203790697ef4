"""Encode feeds the VAE uint8 pixels and normalises them on the device (issue 11 item 8.1).

The old path built a float32 NCHW batch on the host (4 bytes per channel value); the new one ships uint8
NHWC (1 byte) and computes x / 127.5 - 1 on the device in the VAE's dtype. On CPU both are the same fp32
operations, so the latents must be bit-identical; on CUDA the division may run as a multiplication by the
reciprocal (<= 1 ulp of the input), far below the bf16/fp16 rounding the encoder adds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from encode.bench import ENCODER_PRECISION
from encode.config import EncodeConfig, EncoderConfig
from encode.precision import latent_precision
from encode.process.encoders import Encoders, host_pixel_batch, load_encoders, pixels_to_vae_input
from encode.process.images import to_model_input
from shared.config import load_config

BATCH, SIDE = 6, 64
# fp32 on CUDA: one ulp of a value in [-1, 1] is 1.2e-7; TF32 convolutions then dominate the difference.
CUDA_FP32_LATENT_ATOL = 1e-2


def _cfg(device: str = "cpu") -> EncodeConfig:
    overrides = [
        "source.uri=unused",
        "output.uri=unused",
        f"encoder.device={device}",
        "encoder.precision=fp32",
    ]
    return load_config(EncodeConfig, "sample", overrides, kind="datasets")


@pytest.fixture(scope="module")
def encoders() -> Encoders:
    return load_encoders(_cfg())


def _pixels(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8) for _ in range(BATCH)]


def _float_path_latents(encoders: Encoders, pixels: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """What encode did before: float32 NCHW in [-1, 1] built on the host, then copied to the device."""
    batch = torch.from_numpy(np.stack([to_model_input(p) for p in pixels])).to(encoders.device)
    with torch.inference_mode():
        dist = encoders.vae.encode(batch).latent_dist
    return dist.mean.float().cpu().numpy(), dist.logvar.float().cpu().numpy()


def test_host_batch_is_uint8_a_quarter_of_the_float_batch() -> None:
    pixels = _pixels()
    host = host_pixel_batch(pixels, pin=False)
    float_batch = np.stack([to_model_input(p) for p in pixels])
    assert host.dtype == torch.uint8 and tuple(host.shape) == (BATCH, SIDE, SIDE, 3)
    assert host.numel() * host.element_size() == BATCH * SIDE * SIDE * 3
    assert float_batch.nbytes == 4 * host.numel() * host.element_size()
    assert np.array_equal(host.numpy(), np.stack(pixels))


def test_device_normalisation_equals_the_host_float_path_bit_for_bit() -> None:
    every_value = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1).repeat(3, axis=3)
    on_device = pixels_to_vae_input(torch.from_numpy(every_value), torch.float32)
    assert on_device.is_contiguous() and tuple(on_device.shape) == (1, 3, 16, 16)
    assert np.array_equal(on_device.numpy(), to_model_input(every_value[0])[None])


def test_latents_identical_to_the_float_path_on_cpu(encoders: Encoders) -> None:
    pixels = _pixels(1)
    mean, logvar = encoders.encode_images(pixels)
    old_mean, old_logvar = _float_path_latents(encoders, pixels)
    assert np.array_equal(mean, old_mean) and np.array_equal(logvar, old_logvar)


def test_mixed_sizes_are_refused_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="one size"):
        host_pixel_batch([np.zeros((8, 8, 3), np.uint8), np.zeros((16, 16, 3), np.uint8)], pin=False)
    with pytest.raises(ValueError, match="uint8 HxWx3"):
        host_pixel_batch([np.zeros((8, 8, 3), np.float32)], pin=False)


@pytest.mark.gpu
def test_cuda_batch_is_pinned_uint8_and_latents_match_the_float_path() -> None:
    encoders = load_encoders(_cfg("cuda"))
    pixels = _pixels(2)
    host = host_pixel_batch(pixels, pin=True)
    assert host.is_pinned() and host.dtype == torch.uint8
    every_value = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16, 1).repeat(1, 1, 1, 3)
    on_device = pixels_to_vae_input(every_value.cuda(), torch.float32)
    assert on_device.is_contiguous(memory_format=torch.channels_last)
    reference = torch.from_numpy(to_model_input(every_value[0].numpy())[None])
    assert (on_device.cpu() - reference).abs().max().item() <= torch.finfo(torch.float32).eps
    mean, logvar = encoders.encode_images(pixels)
    old_mean, old_logvar = _float_path_latents(encoders, pixels)
    assert np.abs(mean - old_mean).max() <= CUDA_FP32_LATENT_ATOL
    assert np.abs(logvar - old_logvar).max() <= CUDA_FP32_LATENT_ATOL


def test_latent_precision_entry_backs_the_fp16_default(encoders: Encoders) -> None:
    """Item 8.4: the bench's `latent_precision` measures each low precision against fp32 in posterior
    stds, and the shipped default is the one that measures closer (fp16's 10-bit mantissa vs bf16's 7)."""
    report = latent_precision(encoders, _pixels(3), batch_size=BATCH)
    assert report["images"] == BATCH and report["posterior_std"]["min"] > 0
    fp16, bf16 = report["fp16"], report["bf16"]
    assert fp16["nonfinite"] == bf16["nonfinite"] == 0
    assert 0 < fp16["max_abs_error"] < bf16["max_abs_error"]
    assert fp16["error_over_std"]["max"] < bf16["error_over_std"]["max"]
    assert EncoderConfig().precision == ENCODER_PRECISION == "fp16"
