"""The demo on bucketed data (`make demo ARGS="--dataset sample-buckets"`, issue 32) renders its prompts
also at a landscape and a portrait bucket: which ones it picks from the exported pipeline's buckets.json.
The rendering itself is diffusers' `StableDiffusionPipeline(height=, width=)`; the bucketed demo end to end
(4 batches) is a `slow` test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.buckets import landscape_and_portrait
from train.export.pipeline import BUCKETS_FILE
from train.tools.demo import DemoPaths, bucket_sample_shapes


def test_the_most_trained_landscape_and_portrait_buckets_are_rendered(tmp_path: Path) -> None:
    counts = {"80x48": 7, "96x48": 9, "64x64": 30, "48x80": 12, "48x96": 3}
    (tmp_path / BUCKETS_FILE).write_text(json.dumps({"resolution": 64, "buckets": counts}))
    assert landscape_and_portrait(counts) == ["48x80", "96x48"]  # the square is the main grid
    assert bucket_sample_shapes(tmp_path) == {"48x80": (48, 80), "96x48": (96, 48)}
    assert DemoPaths(tmp_path).bucket_samples("48x80") == tmp_path / "samples-48x80.png"


def test_a_square_model_renders_the_square_grid_only(tmp_path: Path) -> None:
    assert bucket_sample_shapes(tmp_path) == {}  # export writes no buckets.json for square-only data
    assert landscape_and_portrait({"64x64": 5}) == []


@pytest.mark.slow  # the whole bucketed demo at 4 batches: ~1 min on 2 loaded cores
def test_bucketed_demo_draws_a_landscape_and_a_portrait_grid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from PIL import Image

    from train.tools.demo import run_demo

    paths = run_demo(tmp_path / "demo", max_duration="4ba", dataset="sample-buckets")
    out = capsys.readouterr().out
    square = Image.open(paths.samples).size
    for name in ("48x80", "80x48"):
        grid = paths.bucket_samples(name)
        assert f"bucket grid      {grid}" in out
        width = int(name.split("x")[1])
        assert Image.open(grid).size[0] == 3 * width  # IMAGES_PER_PROMPT tiles per row at the bucket's width
    assert square[0] == 3 * 64
