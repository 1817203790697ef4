"""Model presets: the shapes of every network both stages build, declared once.

`sd2-base` is Stable Diffusion 2 base (see the numbers in the README's "Model" section): its VAE, tokenizer
and text encoder come from a diffusers-format folder or hub id (`pretrained`), its U-Net is built from the
config below for pretraining. `tiny` uses the same classes at toy sizes, random-initialised from a fixed
seed (identical on every machine for the pinned torch), so tests and the demo run on a laptop CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent / "assets"

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
    "norm_num_groups": 8,
    "sample_size": 64,
    "scaling_factor": 1.0,
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
        vae_weights=None,
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; use one of {', '.join(sorted(PRESETS))}") from None
