"""Checkpoint -> diffusers StableDiffusionPipeline folder (EMA U-Net + the dataset's VAE and text encoder).

The checkpoint's RunRecord says which encoders made the latents (`encoder_config`: pretrained source and
text backend) and their weight fingerprints; we rebuild them the same way and refuse to export when the
fingerprints differ (the U-Net would be paired with a VAE/text encoder it never saw). The VAE's
`scaling_factor` is set to the one training applied, and the U-Net's `sample_size` to the trained latent size.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared import storage
from shared.config import build_dataclass
from shared.models import (
    build_text_encoder,
    build_tokenizer,
    build_vae,
    openclip_to_transformers,
    weights_fingerprint,
)
from shared.presets import Preset, get_preset
from train.checkpoints import fetch_checkpoint, read_checkpoint
from train.config import ModelConfig, SamplerKind
from train.ema import select_unet_weights
from train.samples import inference_scheduler

log = logging.getLogger(__name__)

RECORD_KEY = "RunRecord"


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message names the fix."""


@dataclass(frozen=True)
class ExportResult:
    out: str
    checkpoint: str
    weights: str  # "ema", "training", or "training (no EMA in checkpoint)"


def run_record_of(state: dict[str, Any]) -> dict[str, Any]:
    record = state.get("callbacks", {}).get(RECORD_KEY)
    if not record:
        raise ExportError("this checkpoint has no RunRecord: it was not written by `python -m train fit`")
    return record


def check_fingerprint(kind: str, recorded: str | None, actual: str, allow: bool) -> None:
    if recorded is None:
        log.warning(
            "the dataset manifest recorded no %s fingerprint; cannot verify the exported %s", kind, kind
        )
        return
    if recorded == actual:
        return
    message = (
        f"the {kind} rebuilt for export ({actual[:24]}...) is not the one the dataset was encoded with "
        f"({recorded[:24]}...); make the dataset's encoder.pretrained / text_backend weights available as "
        "they were at encode time, or pass --allow-encoder-mismatch to export anyway"
    )
    if not allow:
        raise ExportError(message)
    log.warning(message)


def export_unet(state: dict[str, Any], record: dict[str, Any], preset: Preset, which: str) -> tuple[Any, str]:
    from diffusers import UNet2DConditionModel

    weights, what = select_unet_weights(state, which)
    unet = UNet2DConditionModel.from_config(record["unet_config"])
    unet.load_state_dict(weights, strict=True)
    unet.register_to_config(sample_size=record["dataset"]["resolution"] // preset.vae_downsample)
    return unet.eval(), what


def export_vae(record: dict[str, Any], preset: Preset, allow: bool) -> Any:
    vae = build_vae(preset, record["encoder_config"].get("pretrained"))
    check_fingerprint("VAE", record["encoders"].get("vae"), weights_fingerprint(vae), allow)
    vae.register_to_config(scaling_factor=float(record["scale_factor"]))
    return vae


def export_text(record: dict[str, Any], preset: Preset, allow: bool) -> tuple[Any, Any]:
    """A transformers CLIPTextModel + tokenizer with encode's text weights (converted from OpenCLIP if so)."""
    enc_cfg = record["encoder_config"]
    backend = enc_cfg.get("text_backend", "transformers")
    pretrained = enc_cfg.get("pretrained")
    encoder = build_text_encoder(preset, backend, pretrained, enc_cfg.get("open_clip_checkpoint"))
    check_fingerprint("text encoder", record["encoders"].get("text"), encoder.fingerprint(), allow)
    if backend == "open_clip":
        return openclip_to_transformers(encoder.model, preset), build_tokenizer(preset, pretrained)
    return encoder.model, encoder.tokenizer


def export_pipeline(
    checkpoint: str,
    out: str,
    sampler: SamplerKind = "ddim",
    weights: str = "ema",
    allow_encoder_mismatch: bool = False,
) -> ExportResult:
    """Write a diffusers folder that `StableDiffusionPipeline.from_pretrained(out)` loads offline."""
    from diffusers import StableDiffusionPipeline

    if weights not in ("ema", "training"):
        raise ExportError(f"weights must be ema or training, got {weights!r}")
    scratch = tempfile.mkdtemp(prefix="sd-export-")
    local_ckpt = fetch_checkpoint(checkpoint, scratch)
    state = read_checkpoint(local_ckpt)["state"]
    record = run_record_of(state)
    preset = get_preset(record["preset"])
    unet, what = export_unet(state, record, preset, weights)
    del state
    text_encoder, tokenizer = export_text(record, preset, allow_encoder_mismatch)
    pipe = StableDiffusionPipeline(
        vae=export_vae(record, preset, allow_encoder_mismatch),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=inference_scheduler(sampler, build_dataclass(ModelConfig, record["model"])),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    target = str(Path(scratch) / "pipeline") if storage.is_s3(out) else out
    pipe.save_pretrained(target, safe_serialization=True)
    if storage.is_s3(out):
        storage.upload_dir(target, out)
    log.info("exported %s weights of %s to %s", what, local_ckpt, out)
    return ExportResult(out, str(local_ckpt), what)
