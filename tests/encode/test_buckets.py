"""Aspect-ratio buckets at encode time: the bucket lists, nearest-bucket assignment and cover crop, and the
encode job writing one MDS stream per bucket with the crop box and original size of every sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from encode.config import EncodeConfig
from encode.plan.fingerprints import EncoderIds, StageFingerprints, stage_fingerprints
from encode.process.encoders import Encoders
from encode.process.images import resize_center_crop, resize_cover
from encode.publish.gc import collect_garbage
from shared import contract, storage
from shared.buckets import auto_buckets, cover_box, cropped_shares, kept_fraction, nearest_bucket
from shared.config import ConfigError
from shared.manifest import Layout
from tests.encode.test_pipeline import encode, encoders, make_cfg, wds  # noqa: F401 (fixtures)

BUCKETED = ["transform.resolutions=[64]", "transform.buckets=auto", "transform.bucket_step=16"]


def test_auto_buckets_follow_kohya() -> None:
    assert auto_buckets(256, 64, 2.0) == [(320, 192), (256, 256), (192, 320)]
    assert auto_buckets(512, 64, 2.0) == [(640, 384), (576, 448), (512, 512), (448, 576), (384, 640)]
    for height, width in auto_buckets(1024, 64, 2.0):
        assert height % 64 == width % 64 == 0 and height * width <= 1024 * 1024
        assert max(height, width) / min(height, width) <= 2.0


def test_nearest_bucket_and_cover_crop() -> None:
    buckets = auto_buckets(256, 64, 2.0)
    assert nearest_bucket(400, 300, buckets) == (192, 320)  # 4:3 landscape
    assert nearest_bucket(300, 400, buckets) == (320, 192)
    assert nearest_bucket(300, 290, buckets) == (256, 256)
    # 4:3 into 3:5: scaled by 0.8 the width fits exactly, the height overhangs 15 px a side (30 source px).
    assert cover_box(400, 300, (192, 320)) == pytest.approx((0, 30, 400, 270))
    assert kept_fraction(400, 300, (192, 320)) == pytest.approx(0.8)  # a centre square keeps 0.75
    assert cover_box(200, 150, (192, 320)) is None  # covering would upscale


def test_square_bucket_equals_centre_crop() -> None:
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (150, 200, 3), dtype=np.uint8))
    assert np.array_equal(resize_cover(img, (64, 64), "bicubic"), resize_center_crop(img, 64, "bicubic"))
    wide = resize_cover(img, (48, 80), "bicubic")
    assert wide is not None and wide.shape == (48, 80, 3)


def test_bucket_config_errors() -> None:
    with pytest.raises(ConfigError, match="bucket_step"):
        make_cfg("in", "out", *BUCKETED[:2], "transform.bucket_step=12")
    with pytest.raises(ConfigError, match="one bucket list per resolution"):
        make_cfg("in", "out", "transform.resolutions=[64]", "transform.buckets={32: [[32, 32]]}")
    with pytest.raises(ConfigError, match="multiples"):
        make_cfg("in", "out", "transform.resolutions=[64]", "transform.buckets={64: [[60, 64]]}")


def test_square_only_fingerprints_as_before() -> None:
    cfg = make_cfg("in", "out")
    ids = EncoderIds("vae", "text", "tok")
    stages = stage_fingerprints(cfg, ids)
    plain = StageFingerprints(stages.select, stages.text, stages.image)  # what the code made before buckets
    assert stages.buckets == {}
    assert stages.recipe("src") == plain.recipe("src")
    assert all(
        stages.output_fingerprint("src", r) == plain.output_fingerprint("src", r) for r in stages.image
    )
    bucketed = stage_fingerprints(make_cfg("in", "out", *BUCKETED), ids)
    assert bucketed.recipe("src") != stage_fingerprints(make_cfg("in", "out", BUCKETED[0]), ids).recipe("src")


def bucket_rows(root: Path, res: int, name: str) -> list[dict]:
    from encode.plan.reuse import iter_mds_rows
    from shared.manifest import read_manifest

    layout = Layout(str(root))
    rows = []
    for part in read_manifest(str(root)).partitions:
        dirname = part["dirs"].get(str(res))
        folder = storage.join(layout.partition_output(res, dirname), name) if dirname else None
        if folder and storage.exists(storage.join(folder, "index.json")):
            rows += list(iter_mds_rows(folder))
    return rows


def test_encode_writes_one_stream_per_bucket(wds: Path, tmp_path: Path, encoders: Encoders) -> None:  # noqa: F811
    out = tmp_path / "out"
    cfg: EncodeConfig = make_cfg(wds, out, *BUCKETED)
    _, result = encode(cfg, encoders)
    info = result.manifest.resolutions[64]
    assert info.shapes.bucketed and info.buckets is not None
    assert list(info.buckets) == ["80x48", "64x64", "48x80"]
    counts = {name: b["num_samples"] for name, b in info.buckets.items()}
    assert sum(counts.values()) == info.num_samples and sum(v > 0 for v in counts.values()) >= 2, counts
    factor = encoders.preset.vae_downsample
    for name, shapes in info.bucket_shapes(64).items():
        rows = bucket_rows(out, 64, name)
        assert len(rows) == counts[name]
        index = storage.read_json(Layout(str(out)).bucket_index(result.manifest.version, 64, name))
        assert sum(s["samples"] for s in index["shards"]) == counts[name]
        for row in rows:
            assert row[contract.LATENT_MEAN].shape == shapes.latent
            height, width = (int(v) for v in name.split("x"))
            assert shapes.latent[1:] == (height // factor, width // factor)
            size = tuple(int(v) for v in row[contract.ORIGINAL_SIZE])
            box = tuple(float(v) for v in row[contract.CROP_BOX])
            assert box == pytest.approx(cover_box(size[1], size[0], (height, width)), abs=1e-3)
    metrics = storage.read_json(str(out / "metrics.json"))
    assert metrics["resolutions"]["64"]["buckets"] == info.buckets
    # A changed list re-encodes only the images that move: dropping the portrait bucket moves portraits.
    portrait = counts["80x48"]
    encoders.images_encoded = 0
    explicit = "transform.buckets={64: [[64, 64], [48, 80]]}"
    _, again = encode(make_cfg(wds, out, BUCKETED[0], explicit), encoders)
    moved = again.manifest.resolutions[64].buckets["64x64"]["num_samples"] - counts["64x64"]
    assert 0 < moved <= portrait and encoders.images_encoded == moved
    # gc drops the first version's partition folders; the current version's bucket streams stay whole.
    report = collect_garbage(Layout(str(out)))
    assert report.deleted_versions == [result.manifest.version] and report.deleted_partition_dirs
    for name, bucket in again.manifest.resolutions[64].buckets.items():
        assert len(bucket_rows(out, 64, name)) == bucket["num_samples"]


def test_back_to_square_only_reuses_the_square_bucket_and_encodes_the_rest(
    wds: Path,  # noqa: F811
    tmp_path: Path,
    encoders: Encoders,  # noqa: F811
) -> None:
    """The bucket list is not in the image fingerprint, so the bucketed latents are offered for reuse: only
    the square bucket's fit a square stream (the others once crashed the rerun with "Wrong shape")."""
    out = tmp_path / "out"
    _, bucketed = encode(make_cfg(wds, out, *BUCKETED), encoders)
    square_bucket = bucketed.manifest.resolutions[64].buckets["64x64"]["num_samples"]
    _, square = encode(make_cfg(wds, out, BUCKETED[0]), encoders)
    kept = square.manifest.resolutions[64].num_samples
    assert encoders.images_encoded == kept - square_bucket > 0
    factor = encoders.preset.vae_downsample
    rows = [row for part in square.manifest.partitions for row in square_rows(out, part, 64)]
    assert len(rows) == kept and {row[contract.LATENT_MEAN].shape[1:] for row in rows} == {
        (64 // factor,) * 2
    }


def square_rows(root: Path, part: dict, res: int) -> list[dict]:
    from encode.plan.reuse import iter_mds_rows

    return list(iter_mds_rows(Layout(str(root)).partition_output(res, part["dirs"][str(res)])))


def test_buckets_keep_a_shape_at_the_edge_that_the_centre_crop_cuts_away() -> None:
    """What the model is trained on: a 5:3 picture with a red circle at its left edge. The centre square
    (what every sample was before buckets) holds none of it; the 48x80 bucket holds all of it. What a model
    trained on such pictures keeps: tests/train/data/test_buckets_model.py."""
    from encode.process.images import resize_for_resolutions
    from encode.sample_data import COLORS, encode_image

    img = Image.new("RGB", (240, 144), COLORS["blue"])
    ImageDraw.Draw(img).ellipse((4, 52, 44, 92), fill=COLORS["red"])
    data = encode_image(img, "PNG")

    def red_pixels(pixels: np.ndarray) -> int:
        return int(((pixels[..., 0] > 150) & (pixels[..., 2] < 120)).sum())

    square = resize_for_resolutions(data, 1 << 24, [64], "bicubic")[64]
    bucketed = resize_for_resolutions(data, 1 << 24, [64], "bicubic", {64: (48, 80)})[64]
    assert square is not None and bucketed is not None and bucketed.shape == (48, 80, 3)
    assert red_pixels(square) == 0
    # The circle's area scaled to the bucket (pi * 20^2 source px at 1/3 scale): all of it is there.
    assert red_pixels(bucketed) >= 0.8 * np.pi * (20 / 3) ** 2


def test_buckets_cut_less_of_each_picture_than_the_centre_crop() -> None:
    """The measured reason (docs/encode.md): the sample data's sizes cut 21% of each picture by centre crop,
    13% with the auto buckets at 64 px and 7% at 128 px (step 16); a 3:2 photo at 512 px loses 33% vs 10%."""
    from encode.sample_data.render import _pick_size

    rng = np.random.default_rng(0)
    sizes = [s for s in (_pick_size(rng) for _ in range(400)) if max(s) / min(s) <= 2.0]
    centre, bucketed, n = cropped_shares(sizes, auto_buckets(128, 16, 2.0))
    assert n > 250 and centre > 0.18 and bucketed < 0.5 * centre
    assert cropped_shares([(1200, 800)], auto_buckets(512, 64, 2.0))[:2] == pytest.approx((1 / 3, 0.1))
