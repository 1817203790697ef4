"""The frozen encoders used by encode: VAE and text tower on the chosen device, batched inference."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from encode.config import EncodeConfig
from encode.images import to_model_input
from encode.plan import EncoderIds
from shared import contract
from shared.models import TextEncoder, build_text_encoder, build_vae, weights_fingerprint
from shared.presets import Preset, get_preset

_AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def pick_device(requested: str) -> torch.device:
    if requested != "auto":
        return torch.device(requested)
    if torch.cuda.is_available():
        # One GPU per rank: torchrun / Composer's launcher set LOCAL_RANK.
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def tokenizer_fingerprint(text: TextEncoder) -> str:
    vocab = text.tokenizer.get_vocab() if hasattr(text.tokenizer, "get_vocab") else text.tokenizer.encoder
    blob = json.dumps(sorted(vocab.items()), separators=(",", ":")).encode()
    return f"{text.backend}:{hashlib.sha256(blob).hexdigest()}"


@dataclass
class Encoders:
    preset: Preset
    vae: Any
    text: TextEncoder
    device: torch.device
    precision: str
    ids: EncoderIds
    # How many captions / images went through each model in this process (tests and metrics read these).
    texts_encoded: int = 0
    images_encoded: int = 0

    def shapes(self, resolution: int) -> contract.Shapes:
        return contract.Shapes(self.preset.latent_shape(resolution), self.preset.text_shape())

    def _autocast(self) -> Any:
        if self.device.type == "cuda" and self.precision in _AUTOCAST:
            return torch.autocast("cuda", dtype=_AUTOCAST[self.precision])
        return nullcontext()  # CPU: fp32 (bf16 autocast on CPU is slow and changes results)

    def encode_text(self, captions: Sequence[str]) -> np.ndarray:
        self.texts_encoded += len(captions)
        with self._autocast():
            return self.text.encode(list(captions)).float().cpu().numpy()

    def encode_images(self, pixels: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """uint8 HWC images of one size -> unscaled posterior (mean, logvar), float32."""
        self.images_encoded += len(pixels)
        batch = torch.from_numpy(np.stack([to_model_input(p) for p in pixels])).to(self.device)
        if self.device.type == "cuda":
            batch = batch.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode(), self._autocast():
            dist = self.vae.encode(batch).latent_dist
        return dist.mean.float().cpu().numpy(), dist.logvar.float().cpu().numpy()

    def empty_caption_embedding(self) -> np.ndarray:
        """The embedding train swaps in for caption dropout (classifier-free guidance)."""
        with self._autocast():
            return self.text.encode([""]).float().cpu().numpy()[0].astype(contract.TEXT_DTYPE)


def load_encoders(cfg: EncodeConfig) -> Encoders:
    preset = get_preset(cfg.preset)
    device = pick_device(cfg.encoder.device)
    vae = build_vae(preset, cfg.encoder.pretrained)
    text = build_text_encoder(
        preset, cfg.encoder.text_backend, cfg.encoder.pretrained, cfg.encoder.open_clip_checkpoint
    )
    # Fingerprint on CPU in fp32 before moving, so the identity does not depend on the device.
    ids = EncoderIds(
        vae=weights_fingerprint(vae), text=text.fingerprint(), tokenizer=tokenizer_fingerprint(text)
    )
    vae.to(device)
    if device.type == "cuda":
        vae.to(memory_format=torch.channels_last)
    text.to(device)
    return Encoders(preset, vae, text, device, cfg.encoder.precision, ids)
