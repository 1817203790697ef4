"""Bucketed data in training: one Streaming stream per bucket, batched per_stream so every batch holds one
latent shape; buckets drawn in proportion to their sizes; `data/buckets/<HxW>` counts in metrics.jsonl up to
the run's last step; a bucketed dataset inside a data.streams mix; the contract check per bucket.

`tiny_bucketed_dataset`: 80x48 (16 rows), 64x64 (24), 48x80 (16) at 64 px. Kills and rank changes:
tests/train/checkpoints/test_resume_buckets.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from shared.contract import LATENT_MEAN, ContractError, Expectation, check_compatible
from shared.manifest import read_manifest
from tests.train.conftest import TINY_BUCKETS, single_threaded_torch, stream_overrides, tiny_config
from train.data.buckets import split_weight
from train.data.stream_counts import BUCKET_PREFIX, METRIC_PREFIX
from train.loop.trainer import fit

SHAPES = {"80x48": (4, 10, 6), "64x64": (4, 8, 8), "48x80": (4, 6, 10)}


def metric_rows(save: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def test_every_batch_is_one_bucket_and_an_epoch_takes_every_bucket_whole(
    tiny_bucketed_dataset: str, tmp_path: Path
) -> None:
    from train.data.buckets import run_streams
    from train.data.loader import build_dataloader
    from train.data.packing import unpack
    from train.loop.prepare import prepare_data

    cfg = tiny_config(tiny_bucketed_dataset, tmp_path / "save", tmp_path / "cache")
    _, pinned, mix = prepare_data(cfg)
    assert sorted(pinned.buckets) == sorted(TINY_BUCKETS)
    streams, labels, method = run_streams(cfg.data.batching_method, pinned, mix, 8, 60)
    assert method == "per_stream" and [label.bucket for label in labels] == list(TINY_BUCKETS)
    with single_threaded_torch():
        loader = build_dataloader(cfg.data, pinned, 8, cfg.seed, streams, method)
        shapes = [tuple(unpack(b)[LATENT_MEAN].shape) for b in loader]
    seen = {name: sum(s == (8, *shape) for s in shapes) for name, shape in SHAPES.items()}
    assert len(shapes) == 7 and seen == {name: n // 8 for name, n in TINY_BUCKETS.items()}
    assert loader.stream_taken.tolist() == list(TINY_BUCKETS.values())
    assert [s[1:] for s in shapes] != sorted(s[1:] for s in shapes), "buckets come shuffled, not in runs"


def test_bucket_counts_reach_the_last_step_of_an_epoch_run(
    tiny_bucketed_dataset: str, tmp_path: Path
) -> None:
    """max_duration=1ep ends at batch 7 with saves and console lines every 5: the last step still carries
    the cumulative bucket counts (Composer's end-of-training check fires only at EPOCH_END). The sample
    grids at the end render the square and the two non-square buckets."""
    save = tmp_path / "save"
    cfg = tiny_config(
        tiny_bucketed_dataset, save, tmp_path / "cache",
        "max_duration=1ep", "save_interval=5ba", "log.console_interval=5ba",
        "samples.interval=10ba", "samples.steps=2", "samples.images_per_prompt=1",
    )  # fmt: skip
    with single_threaded_torch():
        fit(cfg)
    rows = metric_rows(save)
    counted = {r["step"]: {k: v for k, v in r.items() if k.startswith(BUCKET_PREFIX)} for r in rows}
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert sorted(s for s, c in counted.items() if c) == [5, 7]
    assert counted[7] == {BUCKET_PREFIX + name: n for name, n in TINY_BUCKETS.items()}
    assert sum(counted[5].values()) == 40
    assert not any(k.startswith(METRIC_PREFIX) for r in rows for k in r), "one dataset: no per-dataset counts"
    # The end-of-run grids: the square one as before, and a landscape and a portrait bucket's.
    grids = {p.name: Image.open(p).size for p in (save / "samples").glob("ba00000007*.png")}
    assert sorted(grids) == ["ba00000007-48x80.png", "ba00000007-80x48.png", "ba00000007.png"]
    assert grids["ba00000007-48x80.png"][0] == 80 and grids["ba00000007-80x48.png"][0] == 48


def test_a_bucketed_dataset_in_a_mix(tiny_bucketed_dataset: str, tiny_dataset_b: str, tmp_path: Path) -> None:
    """A mix of a bucketed dataset and a square one: counts per dataset and per bucket. One epoch (11
    batches) with saves every 5: the last step carries them (issue 33 item 5, with data.streams)."""
    save = tmp_path / "save"
    mix = stream_overrides(
        f"{{uri: {tiny_bucketed_dataset}, name: laion}}", f"{{uri: {tiny_dataset_b}, name: coyo}}"
    )
    cfg = tiny_config(
        "", save, tmp_path / "cache", *mix,
        "max_duration=1ep", "save_interval=5ba", "log.console_interval=5ba", "samples.enabled=false",
    )  # fmt: skip
    with single_threaded_torch():
        fit(cfg)
    last = metric_rows(save)[-1]
    assert last["step"] == 11
    assert last[METRIC_PREFIX + "laion"] == 56 and last[METRIC_PREFIX + "coyo"] == 32
    assert {k: v for k, v in last.items() if k.startswith(BUCKET_PREFIX)} == {
        BUCKET_PREFIX + name: n for name, n in TINY_BUCKETS.items()
    }


def test_a_mix_weight_that_leaves_a_bucket_less_than_a_batch_an_epoch_is_refused_before_a_model(
    tiny_bucketed_dataset: str, tiny_dataset_b: str, tmp_path: Path
) -> None:
    """88 samples an epoch; 0.1 of them for the bucketed dataset is 2-4 a bucket, under one global batch of
    8: Streaming's per_stream batching stopped on it with a traceback after the model was built."""
    from train.data.streaming_host import DataError
    from train.loop.prepare import prepare_run

    def mix(share: float) -> Any:
        streams = stream_overrides(
            f"{{uri: {tiny_bucketed_dataset}, name: laion, proportion: {share}}}",
            f"{{uri: {tiny_dataset_b}, name: coyo, proportion: {1 - share}}}",
        )
        return tiny_config("", tmp_path / "save", tmp_path / "cache", *streams, "samples.enabled=false")

    with pytest.raises(DataError, match=r"laion bucket 80x48: 2 samples; laion bucket 64x64: 3 samples"):
        prepare_run(mix(0.1))
    prepare_run(mix(0.7))  # 61 samples: 17, 26 and 17 a bucket


def test_split_weight_keeps_the_dataset_weight() -> None:
    assert split_weight(None, [1, 2]) == [{}, {}]
    assert split_weight(("repeat", 2.0), [1, 3]) == [{"repeat": 2.0}, {"repeat": 2.0}]
    assert split_weight(("proportion", 0.5), [1, 3]) == [{"proportion": 0.125}, {"proportion": 0.375}]
    chosen = split_weight(("choose", 10), [16, 24, 16])
    assert sum(c["choose"] for c in chosen) == 10 and chosen[1]["choose"] == 4


def test_contract_refuses_a_bucket_the_unet_cannot_take(tiny_bucketed_dataset: str) -> None:
    manifest = read_manifest(tiny_bucketed_dataset)
    check_compatible(manifest, Expectation(64, (4, 8, 8), (77, 32), latent_multiple=2))
    with pytest.raises(ContractError, match=r"bucket 80x48 .* multiples of 4"):
        check_compatible(manifest, Expectation(64, (4, 8, 8), (77, 32), latent_multiple=4))


def test_compile_makes_one_static_graph_per_bucket() -> None:
    """Three bucket shapes, each seen twice: three graphs, none dynamic (dynamo's default would make the
    second shape's graph dynamic and reuse it)."""
    import torch
    from torch._dynamo.testing import CompileCounter

    from train.data.buckets import compile_per_bucket

    conv = torch.nn.Conv2d(4, 4, 3, padding=1)
    with torch._dynamo.config.patch(
        recompile_limit=8, accumulated_recompile_limit=256, automatic_dynamic_shapes=True
    ):
        assert compile_per_bucket(3, compile=True)
        assert torch._dynamo.config.recompile_limit == 24
        counted = CompileCounter()
        compiled = torch.compile(conv, backend=counted)
        for shape in [(10, 6), (8, 8), (6, 10)] * 2:
            compiled(torch.zeros(2, 4, *shape))
    torch._dynamo.reset()
    assert counted.frame_count == 3
    assert compile_per_bucket(3, compile=False) == "" and compile_per_bucket(1, compile=True) == ""


def test_dry_run_prices_the_bucket_mix(tiny_bucketed_dataset: str, tmp_path: Path) -> None:
    from train.data.mix import plan_lines

    cfg = tiny_config(tiny_bucketed_dataset, tmp_path / "save", tmp_path / "cache")
    lines = plan_lines(cfg.data, 17)
    # 16 x 3840 + 24 x 4096 + 16 x 3840 px over 56 x 4096: 0.964 of a square step's FLOPs.
    assert "buckets: 80x48 16 (28.6%), 64x64 24 (42.9%), 48x80 16 (28.6%); compute x0.964" in lines[-1]


def test_dry_run_estimate_prices_the_bucket_mix_by_pixels(
    tiny_bucketed_dataset: str, tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's time and cost count a bucketed epoch's FLOPs, not square steps (issue 32)."""
    import re

    from shared.config import load_config
    from train import launch
    from train.config import TrainConfig
    from train.data.mix import data_cost_factor

    bucketed = tiny_config(tiny_bucketed_dataset, tmp_path / "save", tmp_path / "cache")
    assert data_cost_factor(bucketed.data, 17) == pytest.approx((32 * 3840 + 24 * 4096) / (56 * 4096))
    assert data_cost_factor(tiny_config(tiny_dataset, tmp_path / "s", tmp_path / "c").data, 17) == 1.0
    # sd2-base at 256 px is what the planner has a throughput for; its data stands in for a bucket mix
    sd2 = load_config(TrainConfig, "sd2-base-256", ["max_duration=1000ba", "data.uri="], kind="train")

    def gpu_hours(factor: float) -> tuple[str, float]:
        monkeypatch.setattr(launch, "data_cost_factor", lambda data, seed: factor)
        line, _rate = launch.run_estimate(sd2, 256, "A100-40GB")
        return line, float(re.search(r"([\d,.]+) GPU-hours", line).group(1).replace(",", ""))

    (square, square_h), (mixed, mixed_h) = gpu_hours(1.0), gpu_hours(0.75)
    assert "bucket mix" not in square
    assert "(bucket mix: compute x0.750, priced as " in mixed
    assert mixed_h == pytest.approx(0.75 * square_h, rel=0.02)


def test_counts_reach_the_last_step_when_per_stream_shortens_the_epoch(tmp_path: Path) -> None:
    """Buckets of 12, 20 and 12 rows give 1 + 2 + 1 full batches of 8, not the 5 (= 44 // 8) Composer
    expects an epoch to hold: the 1-epoch run ends at step 4, which still carries the counts."""
    from tests.train.conftest import write_fake_dataset

    data, save = tmp_path / "data", tmp_path / "save"
    with single_threaded_torch():
        write_fake_dataset(data, buckets={"80x48": 12, "64x64": 20, "48x80": 12}, seed=3)
        cfg = tiny_config(
            str(data), save, tmp_path / "cache",
            "max_duration=1ep", "save_interval=3ba", "log.console_interval=3ba", "samples.enabled=false",
        )  # fmt: skip
        fit(cfg)
    last = metric_rows(save)[-1]
    assert last["step"] == 4 and "loss" in last
    assert {k: v for k, v in last.items() if k.startswith(BUCKET_PREFIX)} == {
        BUCKET_PREFIX + "80x48": 8,
        BUCKET_PREFIX + "64x64": 16,
        BUCKET_PREFIX + "48x80": 8,
    }


def test_eval_takes_one_bucket_and_export_records_the_buckets(
    tiny_run: Any, tiny_bucketed_dataset: str, tmp_path: Path
) -> None:
    """`train eval --size HxW` on a bucketed eval dataset (its square bucket by default); a size the data
    lacks is refused naming those it has; export's buckets.json comes from the run's dataset record."""
    from train.data.streaming_host import DataError
    from train.eval.checkpoint import evaluate_checkpoint
    from train.eval.images import ImageEvalSpec
    from train.export.pipeline import trained_buckets

    args = [f"uri={tiny_bucketed_dataset}", "num_samples=8"]
    cache = str(tmp_path / "cache")
    square = evaluate_checkpoint(str(tiny_run.save), "ema", args, cache)
    wide = evaluate_checkpoint(str(tiny_run.save), "ema", args, cache, size="48x80")
    assert set(square.metrics) == set(wide.metrics) and square.metrics != wide.metrics
    with pytest.raises(DataError, match=r"no samples in bucket 32x128 .* 80x48, 64x64, 48x80"):
        evaluate_checkpoint(str(tiny_run.save), "ema", args, cache, size="32x128")
    spec = ImageEvalSpec("m", "p", "r", "w", "c", str(tmp_path), size="48x80")
    assert spec.hw() == {"height": 48, "width": 80}
    with pytest.raises(ValueError, match="multiples of 8"):
        ImageEvalSpec("m", "p", "r", "w", "c", str(tmp_path), size="50x80")
    record = {"resolution": 64, "streams": [{"buckets": {"48x80": 3}}, {"buckets": {"48x80": 2, "64x64": 1}}]}
    assert trained_buckets(record) == {"resolution": 64, "buckets": {"48x80": 5, "64x64": 1}}
    assert trained_buckets({"resolution": 64}) is None


def test_fid_reference_is_cut_to_the_bucket() -> None:
    from train.eval.reference import content_key, decode_resized

    rng = np.random.default_rng(0)
    data = encode_png(rng.integers(0, 255, (150, 200, 3), dtype=np.uint8))
    assert tuple(decode_resized(data, (48, 80)).shape) == (3, 48, 80)
    assert tuple(decode_resized(data, 64).shape) == (3, 64, 64)
    assert content_key([data], __file__, (48, 80)) != content_key([data], __file__, 64)


def encode_png(pixels: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()
