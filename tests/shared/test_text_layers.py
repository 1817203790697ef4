"""The transformers text path gives SD2's embedding (penultimate layer + final LN) or refuses, naming both
layer counts: a user's own diffusers folder with the full tower would silently give the last layer."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared import models
from shared.presets import get_preset

TINY = get_preset("tiny")  # a 3-layer tower: diffusers' converted text_encoder keeps 2


def save_text_encoder(root: Path, layers: int) -> str:
    """A diffusers-style folder holding only text_encoder/ with a tiny random CLIPTextModel."""
    from transformers import CLIPTextModel

    CLIPTextModel(models.clip_text_config(TINY, layers)).save_pretrained(root / "text_encoder")
    return str(root)


def test_full_tower_is_refused_naming_both_layer_counts(tmp_path: Path) -> None:
    folder = save_text_encoder(tmp_path, layers=TINY.text["layers"])
    with pytest.raises(models.TextLayerError, match=r"has 3 layers but preset tiny expects 2.*LAST layer"):
        models.build_text_encoder(TINY, "transformers", pretrained=folder)


def test_too_short_tower_is_refused(tmp_path: Path) -> None:
    folder = save_text_encoder(tmp_path, layers=1)
    with pytest.raises(models.TextLayerError, match=r"has 1 layers but preset tiny expects 2.*text_backend"):
        models.build_text_encoder(TINY, "transformers", pretrained=folder)


def test_converted_tower_passes_the_check(tmp_path: Path) -> None:
    from transformers import CLIPTextModel

    folder = save_text_encoder(tmp_path, layers=models.penultimate_layer_count(TINY))
    model = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder")
    models.check_penultimate_layer(model, TINY, folder)  # no error
    assert models.penultimate_layer_count(get_preset("sd2-base")) == 23
