"""`make bench`'s text.store section: stored embeddings vs token ids + text tower, in one run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from shared.runtime.device import resolve_device_setup
from train.bench.config import load_bench_config, load_recipe
from train.bench.step import count_flops
from train.bench.text_store import bench_text_store

# Both resolutions of the comparison, at 64 / 128 px so the four timed tiny steps take seconds.
MINIMAL = [
    "step.batch_size=1",
    "step.warmup=0",
    "step.repeats=1",
    "threads=1",
    "step.text_store_resolutions=[64,128]",
]


def test_bench_measures_the_tokens_over_embeddings_ratio_at_both_resolutions(tmp_path: Path) -> None:
    assert load_bench_config("quick").step.text_store_at() == [256, 512]  # tiny shapes, SD2 resolutions
    cfg = load_bench_config("quick", MINIMAL)
    setup = resolve_device_setup("cpu", "fp32", channels_last=False)
    flops = count_flops(cfg.preset, [64, 128])
    out = bench_text_store(load_recipe(cfg, setup, tmp_path), setup, cfg.step, flops, cfg.seed)
    assert set(out) == {"64", "128"}
    for res, entry in out.items():
        assert math.isfinite(entry["ratio"]) and entry["ratio"] > 0, res
        ideal = (flops[int(res)].unet_train_step + flops[int(res)].text_tower) / flops[
            int(res)
        ].unet_train_step
        assert entry["flop_ideal_ratio"] == pytest.approx(ideal) and ideal > 1
        assert entry["tokens_step"]["median_s"] > 0 and entry["embeddings_step"]["median_s"] > 0


def test_sd2_cpu_config_measures_text_store_at_both_sd2_resolutions() -> None:
    cfg = load_bench_config("sd2-base-cpu")
    assert cfg.preset == "sd2-base" and cfg.step.text_store_at() == [256, 512]
    assert load_bench_config("quick", ["step.text_store=false"]).step.text_store_at() == []


def test_sd2_text_tower_flops_are_about_45_gflop() -> None:
    flops = count_flops("sd2-base", [256])[256]
    assert flops.text_tower / 1e9 == pytest.approx(45, rel=0.05)
    assert (flops.unet_train_step + flops.text_tower) / flops.unet_train_step == pytest.approx(1.08, abs=0.01)
