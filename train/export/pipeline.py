"""Checkpoint -> diffusers StableDiffusionPipeline folder (EMA U-Net + the dataset's VAE and text encoder).

The checkpoint's RunRecord says which encoders made the latents (its EncoderIdentity, shared/encoders.py:
pretrained source, text backend, weight fingerprints; older checkpoints: `encoders` + `encoder_config`),
whichever text.store the dataset used; we rebuild them the same way and refuse to export when the
fingerprints differ (the U-Net would be paired with a VAE/text encoder it never saw). The VAE's
`scaling_factor` is set to the one training applied, and the U-Net's `sample_size` to the trained latent size.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared import storage
from shared.config import build_dataclass
from shared.encoders import EncoderIdentity
from shared.models import (
    build_tokenizer,
    build_vae,
    openclip_to_transformers,
    weights_fingerprint,
)
from shared.presets import Preset, get_preset
from train.checkpoints.files import fetched_checkpoint, resolve_checkpoint
from train.checkpoints.sharded import read_full_checkpoint
from train.config import ModelConfig, SamplerKind
from train.ema.algorithm import select_unet_weights
from train.export.samples import inference_scheduler

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
    identity = EncoderIdentity.from_record(record)
    vae = build_vae(preset, identity.pretrained)
    check_fingerprint("VAE", identity.vae_hash, weights_fingerprint(vae), allow)
    vae.register_to_config(scaling_factor=float(record["scale_factor"]))
    return vae


def export_text(record: dict[str, Any], preset: Preset, allow: bool) -> tuple[Any, Any]:
    """A transformers CLIPTextModel + tokenizer with encode's text weights (converted from OpenCLIP if so)."""
    identity = EncoderIdentity.from_record(record)
    encoder = identity.build_text_encoder()
    check_fingerprint("text encoder", identity.text_hash, encoder.fingerprint(), allow)
    if identity.text_backend == "open_clip":
        return openclip_to_transformers(encoder.model, preset), build_tokenizer(preset, identity.pretrained)
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
    source = resolve_checkpoint(checkpoint)
    with fetched_checkpoint(source) as local_ckpt:  # an s3:// download is removed when this block ends
        state = read_full_checkpoint(local_ckpt)["state"]
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
    save_pipeline(pipe, out, trained_buckets(record["dataset"]))
    log.info("exported %s weights of %s to %s", what, source, out)
    return ExportResult(out, source, what)


BUCKETS_FILE = "buckets.json"  # the aspect-ratio buckets the U-Net was trained on (bucketed data only)


def trained_buckets(dataset: dict[str, Any]) -> dict[str, Any] | None:
    """{"resolution": R, "buckets": {"HxW": samples}} from the run's dataset record (summed over a mix's
    bucketed streams); None when it trained on squares only. Generate at these sizes (height=, width=)."""
    found: dict[str, int] = {}
    for record in [dataset, *dataset.get("streams", [])]:
        for name, count in (record.get("buckets") or {}).items():
            found[name] = found.get(name, 0) + int(count)
    if not found:
        return None
    return {"resolution": dataset["resolution"], "buckets": found}


def save_pipeline(pipe: Any, out: str, buckets: dict[str, Any] | None = None) -> None:
    """save_pretrained to a local folder, or stage it in a scratch folder (removed after) for s3://; with
    `buckets`, a buckets.json beside model_index.json."""
    if not storage.is_s3(out):
        pipe.save_pretrained(out, safe_serialization=True)
        _write_buckets(out, buckets)
        return
    with tempfile.TemporaryDirectory(prefix="sd-export-") as scratch:
        target = str(Path(scratch) / "pipeline")
        pipe.save_pretrained(target, safe_serialization=True)
        _write_buckets(target, buckets)
        storage.upload_dir(target, out)
    stale = storage.join(out, BUCKETS_FILE)
    if buckets is None and storage.exists(stale):  # an earlier export's, into the same folder
        storage.delete(stale)


def _write_buckets(folder: str, buckets: dict[str, Any] | None) -> None:
    """buckets.json, or none: an earlier export's into the same folder would claim buckets this model was
    never trained on (samples and evals read it)."""
    path = Path(folder, BUCKETS_FILE)
    if buckets is not None:
        path.write_text(json.dumps(buckets, indent=1) + "\n")
    else:
        path.unlink(missing_ok=True)
