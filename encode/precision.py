"""How far the encoders' low precisions move the VAE posterior from a strict fp32 encode: `make bench`'s
`latent_precision` and the VAE-alone variants' error columns (encode/vae_speed.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from encode.process.encoders import Encoders


def latent_precision(encoders: Encoders, pixels: Sequence[np.ndarray], batch_size: int) -> dict[str, Any]:
    """How far fp16 / bf16 (and fp32 with TF32 convolutions on a GPU) move the posterior mean from a strict
    fp32 encode, in units of the posterior std that training samples with (latent = mean + std * noise).

    An error well below 1 std is invisible to training; one near or above it replaces the encoder's
    uncertainty with rounding. On CPU fp16 / bf16 run under CPU autocast (encode itself runs fp32 there).
    """
    import torch

    from encode.process.encoders import host_pixel_batch, pixels_to_vae_input

    device, vae = encoders.device, encoders.vae
    batches = [
        pixels_to_vae_input(host_pixel_batch(b, pin=False).to(device), vae.dtype)
        for b in (pixels[i : i + batch_size] for i in range(0, len(pixels), batch_size))
    ]
    with strict_fp32():
        ref_mean, ref_std = _posterior(vae, batches, None)
    out: dict[str, Any] = {
        "images": len(pixels),
        "resolution": int(pixels[0].shape[0]),
        "device": str(device),
        "posterior_std": quantiles(ref_std),
        "abs_mean": {"max": float(ref_mean.abs().max())},
    }
    names = ("fp32", "fp16", "bf16") if device.type == "cuda" else ("fp16", "bf16")
    for name in names:
        dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
        mean, _ = _posterior(vae, batches, dtype)
        error = (mean - ref_mean).abs()
        ratio = error / ref_std
        out[name] = {
            "max_abs_error": float(error.max()),
            "error_over_std": quantiles(ratio),
            "share_above_0.1_std": float((ratio > 0.1).float().mean()),
            "nonfinite": int((~torch.isfinite(mean)).sum()),
        }
    return out


def _posterior(vae: Any, batches: list[Any], dtype: Any) -> tuple[Any, Any]:
    """(mean, std) of the VAE posterior over all batches, float32 on the CPU; `dtype`: autocast to it."""
    import torch

    means, stds = [], []
    for batch in batches:
        ctx = torch.autocast(batch.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            dist = vae.encode(batch).latent_dist
        means.append(dist.mean.float().cpu())
        stds.append(dist.std.float().cpu())
    return torch.cat(means), torch.cat(stds)


def strict_fp32() -> Any:
    """fp32 without TF32 (cuDNN convolutions use TF32 by default, whose 10-bit mantissa is fp16's)."""
    import torch

    stack = contextlib.ExitStack()
    stack.enter_context(torch.backends.cudnn.flags(enabled=True, allow_tf32=False))
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    stack.callback(setattr, torch.backends.cuda.matmul, "allow_tf32", matmul)
    return stack


def quantiles(values: Any) -> dict[str, float]:
    flat = values.flatten().double()
    q = (
        flat.quantile(flat.new_tensor([0.5, 0.99]))
        if flat.numel() <= 1 << 24
        else flat[: 1 << 24].quantile(flat.new_tensor([0.5, 0.99]))
    )
    return {"min": float(flat.min()), "median": float(q[0]), "p99": float(q[1]), "max": float(flat.max())}
