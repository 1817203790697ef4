"""Sample grids say what they show: each row's prompt above it and step / guidance / sampler on top."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from train.export.samples import LABEL_BACKGROUND, save_grid

PROMPTS = ("a red circle on a blue background", "a yellow square on a green background")


def tiles(count: int, size: int = 64) -> torch.Tensor:
    """Solid mid-grey tiles: any other pixel in the grid is label text."""
    return torch.full((count, 3, size, size), 128, dtype=torch.uint8)


def text_rows(grid: np.ndarray) -> np.ndarray:
    """Row indices holding ink: neither the label background nor the tiles' grey."""
    ink = (grid != np.array(LABEL_BACKGROUND)).any(-1) & (grid != 128).any(-1)
    return np.flatnonzero(ink.any(1))


def test_every_row_gets_its_prompt_and_the_grid_its_title(tmp_path: Path) -> None:
    path = tmp_path / "grid.png"
    save_grid(tiles(6), str(path), 3, PROMPTS, "step 600, guidance 4")
    grid = np.asarray(Image.open(path).convert("RGB"))
    tile_rows = np.flatnonzero((grid == 128).all(-1).all(1))
    assert grid.shape[1] == 3 * 64 and len(tile_rows) == 2 * 64  # 6 images in 2 rows of 3
    first_row_end, second_row_start = tile_rows[63], tile_rows[64]
    assert second_row_start > first_row_end + 1  # a band of text between the rows
    ink = text_rows(grid)
    assert (ink < tile_rows[0]).any()  # title and first prompt above the first row
    assert ((ink > first_row_end) & (ink < second_row_start)).any()  # second prompt above the second


def test_long_prompts_wrap_inside_a_narrow_grid(tmp_path: Path) -> None:
    """Two 64 px tiles (the tiny run's grid) are narrower than a prompt: it wraps, nothing is cut."""
    narrow, wide = tmp_path / "narrow.png", tmp_path / "wide.png"
    save_grid(tiles(2), str(narrow), 2, PROMPTS[:1])
    save_grid(tiles(8), str(wide), 8, PROMPTS[:1])
    assert Image.open(narrow).height - 64 > Image.open(wide).height - 64  # more lines of text


def test_without_labels_the_grid_is_just_the_tiles(tmp_path: Path) -> None:
    path = tmp_path / "plain.png"
    save_grid(tiles(4), str(path), 2)
    assert Image.open(path).size == (128, 128)
