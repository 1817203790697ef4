"""Model presets: the shapes of every network both stages build, declared once.

`sd2-base` is Stable Diffusion 2 base (docs/train.md describes the model): its VAE, tokenizer
and text encoder come from a diffusers-format folder or hub id (`pretrained`), its U-Net is built from the
config below for pretraining. `tiny` uses the same classes at toy sizes, random-initialised from a fixed
seed (identical on every machine for the pinned torch), so tests and the demo run on a laptop CPU.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent / "assets"
# The tiny VAE ships trained on the bundled sample data (`make tiny-vae` rebuilds both files), so demo
# samples decode to pictures; its JSON records the scaling factor measured on that data.
TINY_VAE_WEIGHTS = ASSETS / "tiny_vae.safetensors"
TINY_VAE_INFO = ASSETS / "tiny_vae.json"


def _shipped_tiny_vae() -> tuple[str | None, float]:
    """(weights path, scaling factor) of the shipped tiny VAE; random init with factor 1 if it is absent."""
    if not TINY_VAE_WEIGHTS.exists():
        return None, 1.0
    return str(TINY_VAE_WEIGHTS), float(json.loads(TINY_VAE_INFO.read_text())["scaling_factor"])


_TINY_VAE_PATH, _TINY_VAE_SCALE = _shipped_tiny_vae()

# The SD2 text tower is OpenCLIP ViT-H/14's; SD2 conditions on its penultimate layer + final LayerNorm.
SD2_TEXT = {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24}
SD2_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": 512,
    "scaling_factor": 0.18215,
}
SD2_UNET = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "attention_head_dim": [5, 10, 20, 20],
    "cross_attention_dim": 1024,
    "use_linear_projection": True,
    "norm_num_groups": 32,
}

# Tiny: same classes, sizes chosen so one CPU core runs a training step in well under a second.
TINY_TEXT = {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 3}
TINY_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [16, 32, 64, 64],
    "layers_per_block": 1,
    "latent_channels": 4,
    # One group: GroupNorm normalises each group over space, so with several groups a flat-coloured region
    # (most of the sample data) comes out the same whatever its colour; one group keeps the colour in the
    # ratios between channels. Measured in short runs: 21.2 / 24.7 dB held-out PSNR at 64 / 128 px vs
    # 20.9 / 23.1 with 8 groups and 3x the steps, and the colours come back right (the shipped weights,
    # 1500 steps: 28.9 / 32.8 dB).
    "norm_num_groups": 1,
    "sample_size": 64,
    "scaling_factor": _TINY_VAE_SCALE,
}
TINY_UNET = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "block_out_channels": [32, 64],
    "layers_per_block": 1,
    "attention_head_dim": [2, 4],
    "cross_attention_dim": 32,
    "use_linear_projection": True,
    "norm_num_groups": 8,
}

# SD2-base's U-Net module tree at a tenth of its widths: the same blocks, 686 parameter tensors and 38 FSDP
# units, so the same ATen ops and Python calls per step, with little arithmetic. Counts the host work of a
# step of SD2 on a CPU (make bench's trainer.host_twin: what FSDP's per-block bookkeeping adds per step).
SD2_SLIM_UNET = SD2_UNET | {
    "block_out_channels": [32, 64, 128, 128],
    "attention_head_dim": [1, 2, 4, 4],
    "cross_attention_dim": TINY_TEXT["width"],
}


@dataclass(frozen=True)
class Preset:
    """Everything that fixes a model family's shapes and where its frozen encoders come from."""

    name: str
    vae: dict[str, Any]
    text: dict[str, Any]
    unet: dict[str, Any]
    # diffusers folder or hub id holding vae/, text_encoder/, tokenizer/ (None: random init from `seed`)
    pretrained: str | None = None
    # tiny only: trained VAE weights shipped in shared/assets (None: random init)
    vae_weights: str | None = None
    seed: int = 0
    prediction_type: str = "epsilon"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def latent_channels(self) -> int:
        return int(self.vae["latent_channels"])

    @property
    def vae_downsample(self) -> int:
        return 2 ** (len(self.vae["block_out_channels"]) - 1)

    @property
    def scale_factor(self) -> float:
        return float(self.vae["scaling_factor"])

    @property
    def text_length(self) -> int:
        return int(self.text["context_length"])

    @property
    def text_width(self) -> int:
        return int(self.text["width"])

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        if resolution % self.vae_downsample:
            raise ValueError(
                f"resolution {resolution} is not a multiple of the {self.name} VAE's downsample factor "
                f"{self.vae_downsample}; pick a multiple of {self.vae_downsample}"
            )
        side = resolution // self.vae_downsample
        return (self.latent_channels, side, side)

    def text_shape(self) -> tuple[int, int]:
        return (self.text_length, self.text_width)


PRESETS: dict[str, Preset] = {
    "sd2-base": Preset(
        name="sd2-base",
        vae=SD2_VAE,
        text=SD2_TEXT,
        unet=SD2_UNET,
        pretrained="stabilityai/stable-diffusion-2-base",
    ),
    "tiny": Preset(
        name="tiny",
        vae=TINY_VAE,
        text=TINY_TEXT,
        unet=TINY_UNET,
        vae_weights=_TINY_VAE_PATH,
    ),
    "sd2-base-slim": Preset(
        name="sd2-base-slim",
        vae=TINY_VAE,
        text=TINY_TEXT,
        unet=SD2_SLIM_UNET,
        vae_weights=_TINY_VAE_PATH,
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; use one of {', '.join(sorted(PRESETS))}") from None


def random_init(preset: Preset) -> Preset:
    """The preset with its frozen encoders random-initialised: shapes, not weights, decide throughput."""
    return dataclasses.replace(preset, pretrained=None, vae_weights=None)
