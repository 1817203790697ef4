"""The VAE encoder alone, for `make bench`: images/s at each resolution for the encoder as encode builds it
and with each speed switch (encoder.low_precision_norms, encoder.compile), and how far each moves the
posterior mean from a strict fp32 encode in units of the posterior std (train's bench adds FLOPs and MFU).

Inputs are random pixels already on the device in the VAE's layout (NHWC on a GPU), so the numbers are the
model's own, not the host's pixel conversion (the encode section times the whole pipeline).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.runtime.device import DeviceSetup

VAE_WARMUP = 2  # untimed batches first: cuDNN autotuning, compilation


def vae_variants(vae: Any, compile: bool) -> dict[str, Any]:
    """name -> VAE: as built, GroupNorm in low precision, and (compile) that one compiled."""
    from encode.process.encoders import speed_up_vae

    variants = {"as_built": vae}
    low = copy.deepcopy(vae)
    speed_up_vae(low, low_precision_norms=True, compile=False)
    variants["low_precision_norms"] = low
    if compile:
        compiled = copy.deepcopy(low)
        speed_up_vae(compiled, low_precision_norms=False, compile=True)
        variants["low_precision_norms+compile"] = compiled
    return variants


def _posterior_mean(vae: Any, pixels: Any, precision: str, setup: DeviceSetup) -> Any:
    import torch

    from shared.runtime.device import AUTOCAST_DTYPES

    dtype = AUTOCAST_DTYPES.get(precision)
    ctx = torch.autocast(pixels.device.type, dtype=dtype, enabled=dtype is not None)
    with torch.inference_mode(), ctx:
        return vae.encode(pixels).latent_dist


def vae_speed(
    vae: Any,
    resolutions: list[int],
    batch_size: int,
    repeats: int,
    precision: str,
    setup: DeviceSetup,
    compile: bool,
) -> dict[str, Any]:
    """Per resolution and variant: images/s of `vae.encode` at `precision` (autocast; on CPU too, as the
    precision check runs it), and the error of the posterior mean over the fp32 posterior std."""
    import torch

    from encode.precision import quantiles, strict_fp32

    variants = vae_variants(vae, compile)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for res in resolutions:
        pixels = (torch.rand((batch_size, 3, res, res), generator=gen) * 2 - 1).to(setup.device)
        if setup.channels_last:
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        with strict_fp32():
            ref = _posterior_mean(vae, pixels, "fp32", setup)
        runs: dict[str, Any] = {}
        for name, model in variants.items():
            run_precision = precision if setup.device.type == "cuda" else "fp32"
            for _ in range(VAE_WARMUP):
                _posterior_mean(model, pixels, run_precision, setup)
            seconds = []
            for _ in range(max(repeats, 1)):
                setup.sync()
                start = time.perf_counter()
                _posterior_mean(model, pixels, run_precision, setup)
                setup.sync()
                seconds.append(time.perf_counter() - start)
            mean = _posterior_mean(model, pixels, precision, setup).mean
            error = (mean.float() - ref.mean.float()).abs() / ref.std.float()
            runs[name] = {
                "images_per_s": batch_size / statistics.median(seconds),
                "precision_timed": run_precision,
                "error_over_std_at_" + precision: quantiles(error.cpu()),
            }
        out[str(res)] = runs
    return out
