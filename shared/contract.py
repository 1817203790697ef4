"""The data contract between encode and train, declared once.

encode writes MDS rows through `mds_columns`/`make_row`; train reads them and checks the dataset manifest
against its model with `check_compatible` before step 1. Latents are stored *unscaled* as the VAE's
diagonal Gaussian (mean, logvar); the VAE scale factor lives in the manifest and train applies it exactly
once, after drawing a fresh sample each time it reads the row. Caption dropout is never baked in: the
empty-caption embedding is stored once in the manifest and swapped in at train time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Bump when the meaning or layout of a column changes; train refuses datasets with another version.
CONTRACT_VERSION = 1

KEY = "key"  # str: the source sample key (img2dataset key, or path relative to the image folder)
CAPTION = "caption"  # str: the caption as read from the source, before cleaning (so text can be redone)
LATENT_MEAN = "latent_mean"  # float16 [C, H/f, W/f]: VAE posterior mean, unscaled
LATENT_LOGVAR = "latent_logvar"  # float16 [C, H/f, W/f]: VAE posterior log-variance
TEXT_EMBEDDING = "text_embedding"  # float16 [L, D]: penultimate text layer + final LayerNorm

LATENT_DTYPE = "float16"
TEXT_DTYPE = "float16"
# diffusers clamps the VAE logvar to this range before exp(); stored values are clamped the same way.
LOGVAR_RANGE = (-30.0, 20.0)


@dataclass(frozen=True)
class Shapes:
    """What fixes a resolution's row layout."""

    latent: tuple[int, int, int]
    text: tuple[int, int]

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Shapes:
        return cls(tuple(obj["latent"]), tuple(obj["text"]))  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        return {"latent": list(self.latent), "text": list(self.text)}


def _nd(dtype: str, shape: tuple[int, ...]) -> str:
    return f"ndarray:{dtype}:{','.join(str(s) for s in shape)}"


def mds_columns(shapes: Shapes) -> dict[str, str]:
    """MDSWriter column encodings: fixed dtype and shape, so a wrong row fails at write time."""
    return {
        KEY: "str",
        CAPTION: "str",
        LATENT_MEAN: _nd(LATENT_DTYPE, shapes.latent),
        LATENT_LOGVAR: _nd(LATENT_DTYPE, shapes.latent),
        TEXT_EMBEDDING: _nd(TEXT_DTYPE, shapes.text),
    }


def make_row(
    key: str, caption: str, latent_mean: np.ndarray, latent_logvar: np.ndarray, text_embedding: np.ndarray
) -> dict[str, Any]:
    """One MDS row, cast to the contract's dtypes (the writer then checks the shapes)."""
    return {
        KEY: key,
        CAPTION: caption,
        LATENT_MEAN: np.ascontiguousarray(latent_mean, dtype=LATENT_DTYPE),
        LATENT_LOGVAR: np.ascontiguousarray(np.clip(latent_logvar, *LOGVAR_RANGE), dtype=LATENT_DTYPE),
        TEXT_EMBEDDING: np.ascontiguousarray(text_embedding, dtype=TEXT_DTYPE),
    }


def bytes_per_row(shapes: Shapes) -> int:
    """Bytes of the fixed-size columns of one row (captions and keys excluded)."""
    item = np.dtype(LATENT_DTYPE).itemsize
    return 2 * item * int(np.prod(shapes.latent)) + np.dtype(TEXT_DTYPE).itemsize * int(np.prod(shapes.text))


class ContractError(ValueError):
    """The dataset and the model disagree; the message names both values and the fix."""


@dataclass(frozen=True)
class Expectation:
    """What a train config needs from a dataset at one resolution."""

    resolution: int
    latent: tuple[int, int, int]
    text: tuple[int, int]
    scale_factor: float | None = None  # None: take the dataset's


def check_compatible(manifest: Any, want: Expectation) -> None:
    """Refuse to train on a dataset that does not fit the model, naming both values and the fix."""
    if manifest.contract_version != CONTRACT_VERSION:
        raise ContractError(
            f"dataset contract version {manifest.contract_version} != this code's {CONTRACT_VERSION}; "
            "re-run `make encode` with this version of the code"
        )
    res = want.resolution
    if res not in manifest.resolutions:
        have = ", ".join(str(r) for r in sorted(manifest.resolutions)) or "none"
        raise ContractError(
            f"dataset has no {res} px data (it has: {have}); set data.resolution to one of those or add "
            f"{res} to the dataset config's transform.resolutions and re-run `make encode`"
        )
    shapes = manifest.resolutions[res].shapes
    if tuple(shapes.latent) != tuple(want.latent):
        raise ContractError(
            f"dataset latents at {res} px are {list(shapes.latent)} but the model expects "
            f"{list(want.latent)}; the U-Net's in_channels / sample size must match the VAE used by encode "
            "(check `preset`)"
        )
    if tuple(shapes.text) != tuple(want.text):
        raise ContractError(
            f"dataset text embeddings are {list(shapes.text)} but the U-Net cross-attention expects "
            f"{list(want.text)}; encode and train must use the same preset's text encoder"
        )
    if want.scale_factor is not None and abs(manifest.scale_factor - want.scale_factor) > 1e-6:
        raise ContractError(
            f"dataset VAE scale factor is {manifest.scale_factor} but the train config says "
            f"{want.scale_factor}; remove model.scale_factor from the train config to use the dataset's"
        )
