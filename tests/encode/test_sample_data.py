"""encode.sample_data: deterministic img2dataset-layout data whose pixels match their captions, and the
hostile tar whose every case is accounted for by sources + filters + images."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from encode import sample_data
from encode.cli import app
from encode.config import CaptionConfig, FilterConfig, SourceConfig
from encode.process.filters import (
    caption_reject_reason,
    clean_caption,
    metadata_reject_reason,
    size_reject_reason,
)
from encode.process.images import ImageRejected, decode_rgb, probe_size, resize_center_crop
from encode.process.prepare import key_is_utf8
from encode.sample_data import COLORS, color_of_caption, parse_caption, sample_captions
from encode.sources import RawSample, Rejected, list_partitions, read_partition
from shared.config import REPO_ROOT
from tests.builders import hostile

COLOR_TOLERANCE = 30  # mean abs difference per channel: JPEG + noise stay well inside it


def digest(folder: Path) -> dict[str, str]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def tar_members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def wds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wds")
    sample_data.build_webdataset(out, shards=2, per_shard=128)
    return out


# ------------------------------------------------------------------------------------------- layout
def test_webdataset_layout_is_img2dataset_like(wds: Path) -> None:
    assert sorted(p.name for p in wds.iterdir()) == [
        "00000.parquet",
        "00000.tar",
        "00000_stats.json",
        "00001.parquet",
        "00001.tar",
        "00001_stats.json",
    ]
    members = tar_members(wds / "00001.tar")
    names = list(members)
    assert len(names) == 3 * 128 and names[:3] == ["000010000.jpg", "000010000.json", "000010000.txt"]
    meta = json.loads(members["000010000.json"])
    expected = {"key", "caption", "url", "width", "height", "original_width", "original_height", "status"}
    assert expected | {"punsafe", "pwatermark", "similarity", "sha256"} <= set(meta)
    assert meta["status"] == "success" and meta["caption"] == members["000010000.txt"].decode()
    assert Image.open(io.BytesIO(members["000010000.jpg"])).size == (meta["width"], meta["height"])
    stats = json.loads((wds / "00001_stats.json").read_text())
    metadata = pq.read_table(wds / "00001.parquet").to_pylist()
    assert stats["successes"] == 128 and stats["count"] == len(metadata) == 132
    assert sum(row["status"] == "failed_to_download" for row in metadata) == 4


def test_builds_are_byte_identical(tmp_path: Path) -> None:
    for run in ("a", "b"):
        sample_data.build_webdataset(tmp_path / run / "wds", shards=1, per_shard=6, seed=3)
        sample_data.build_parquet(tmp_path / run / "pq", shards=1, per_shard=6)
        sample_data.build_image_folder(tmp_path / run / "folder", count=6)
        hostile.build_hostile_webdataset(tmp_path / run / "hostile" / "h.tar")
    for sub in ("wds", "pq", "folder", "hostile"):
        assert digest(tmp_path / "a" / sub) == digest(tmp_path / "b" / sub), sub
    sample_data.build_webdataset(tmp_path / "c", shards=1, per_shard=6, seed=4)
    assert digest(tmp_path / "c")["00000.tar"] != digest(tmp_path / "a" / "wds")["00000.tar"]


def test_size_and_metadata_mix_gives_filters_work(wds: Path) -> None:
    metas = [
        json.loads(data)
        for shard in ("00000.tar", "00001.tar")
        for name, data in tar_members(wds / shard).items()
        if name.endswith(".json")
    ]
    short = np.array([min(m["width"], m["height"]) for m in metas])
    aspect = np.array([max(m["width"], m["height"]) / min(m["width"], m["height"]) for m in metas])
    assert (short >= 128).mean() > 0.7
    assert ((short >= 64) & (short < 128)).sum() >= 5 and (short < 64).sum() >= 3
    assert (aspect > 2).sum() >= 3
    defaults = FilterConfig()
    reasons = collections.Counter(metadata_reject_reason(m, defaults) for m in metas)
    assert reasons["punsafe"] >= 3 and reasons["pwatermark"] >= 3 and reasons[None] > 0.8 * len(metas)


def test_pixels_match_their_captions(wds: Path) -> None:
    """The shape's colour covers the centre and the background's fills the corners, for every sample."""
    cfg = SourceConfig(uri=str(wds))
    captions = collections.Counter()
    for item in read_partition(list_partitions(cfg)[0], cfg):
        assert isinstance(item, RawSample)
        colors = color_of_caption(item.caption)  # type: ignore[arg-type]
        assert colors is not None, item.caption
        pixels = np.asarray(decode_rgb(item.image, 1 << 30)).astype(int)  # type: ignore[arg-type]
        h, w = pixels.shape[:2]
        centre = pixels[h // 2 - 1 : h // 2 + 2, w // 2 - 1 : w // 2 + 2].reshape(-1, 3).mean(0)
        corner = pixels[:3, :3].reshape(-1, 3).mean(0)
        assert np.abs(centre - COLORS[colors[0]]).mean() < COLOR_TOLERANCE, item.caption
        assert np.abs(corner - COLORS[colors[1]]).mean() < COLOR_TOLERANCE, item.caption
        captions[item.caption] += 1
    assert len(captions) > 40  # phrasing and colour combinations vary


def test_parquet_and_folder_builders(tmp_path: Path) -> None:
    paths = sample_data.build_parquet(tmp_path / "pq", shards=2, per_shard=32)
    assert [p.name for p in paths] == ["00000.parquet", "00001.parquet"]
    table = pq.read_table(paths[1])
    assert {"key", "caption", "jpg", "url", "width", "height", "punsafe", "NSFW"} <= set(table.column_names)
    assert table.num_rows == 33 and pq.ParquetFile(paths[1]).num_row_groups == 3
    assert table.column("key").to_pylist()[0] == "000010000"
    folder = sample_data.build_image_folder(tmp_path / "folder", count=20)
    images = sorted(p for p in folder.rglob("*") if p.suffix in (".jpg", ".png"))
    assert len(images) == 20 and any(p.suffix == ".png" for p in images)
    assert any(p.parent.name == "more" for p in images)
    assert all(p.with_suffix(".txt").exists() for p in images)
    assert len(list(folder.rglob("*.json"))) == 7


# ----------------------------------------------------------------------------------------- captions
def test_caption_parsing() -> None:
    for caption in sample_captions():
        assert parse_caption(caption) is not None
    assert color_of_caption("a red circle on a blue background") == ("red", "blue")
    assert color_of_caption("yellow background with a green triangle") == ("green", "yellow")
    assert color_of_caption("Black square, WHITE backdrop") == ("black", "white")
    assert parse_caption("A blue circle in the middle of a red backdrop.") == ("blue", "circle", "red")
    assert color_of_caption("a photo of a dog") is None
    for template in sample_data.CAPTION_TEMPLATES:
        text = template.format(fg="green", bg="black", shape="square")
        assert parse_caption(text) == ("green", "square", "black"), template


# ------------------------------------------------------------------------------------------ hostile
def classify(item: RawSample | Rejected, filters: FilterConfig, captions: CaptionConfig) -> str:
    """What the encode pipeline decides for one item (metadata, header size, caption, then decode)."""
    if isinstance(item, Rejected):
        return item.reason
    if not key_is_utf8(item.key):
        return "key_not_utf8"
    reason = metadata_reject_reason(item.meta, filters)
    try:
        reason = reason or size_reject_reason(*probe_size(item.image), filters)  # type: ignore[arg-type]
        reason = reason or caption_reject_reason(clean_caption(item.caption, captions), filters)  # type: ignore[arg-type]
        if reason:
            return reason
        img = decode_rgb(item.image, filters.max_pixels)  # type: ignore[arg-type]
    except ImageRejected as err:
        return err.reason
    assert img.mode == "RGB"
    crop = resize_center_crop(img, filters.min_size, "bicubic")
    assert crop is not None and crop.shape == (filters.min_size, filters.min_size, 3)
    return "good"


def test_hostile_webdataset_every_case_is_accounted_for(tmp_path: Path) -> None:
    expected = hostile.build_hostile_webdataset(tmp_path / "hostile.tar")
    cfg = SourceConfig(uri=str(tmp_path / "hostile.tar"))
    items = list(read_partition(list_partitions(cfg)[0], cfg))
    outcomes = collections.Counter()
    by_key = {}
    for item in items:
        outcome = classify(item, FilterConfig(), CaptionConfig())
        outcomes[outcome] += item.count if isinstance(item, Rejected) else 1
        by_key.setdefault(item.key, outcome)
    assert dict(outcomes) == expected
    assert expected["good"] >= 10 and expected["unsafe_member_name"] == 3
    must_survive = ["cmyk_jpeg", "rgba_png", "palette_png", "gray16_png", "gray_png", "webp", "exif_rotated"]
    for name in [*must_survive, "huge_legal", "bad_json", "html_caption"]:
        assert [o for k, o in by_key.items() if k and name in k] == ["good"], name
    rotated = next(i for i in items if isinstance(i, RawSample) and "exif_rotated" in i.key)
    pixels = np.asarray(decode_rgb(rotated.image, 1 << 30))  # type: ignore[arg-type]
    assert pixels.shape[:2] == (320, 256)  # portrait once upright
    assert np.abs(pixels[40, 128].astype(int) - COLORS["red"]).max() < COLOR_TOLERANCE  # red on top
    html = next(i for i in items if isinstance(i, RawSample) and "html_caption" in i.key)
    assert clean_caption(html.caption, CaptionConfig()) == "a red circle & friend on a blue background"  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------- CLI
def test_cli_builds_and_prints_the_path(tmp_path: Path) -> None:
    args = ["sample-data", "--out", str(tmp_path / "s"), "--shards", "1", "--per-shard", "4"]
    result = CliRunner().invoke(app, args)
    out = tmp_path / "s" / "webdataset"
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out)
    assert (out / "00000.tar").exists() and not (out / "00001.tar").exists()
    result = subprocess.run(
        [sys.executable, "-m", "encode", "sample-data", "--out", str(tmp_path / "h"), "--format", "folder"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(result.stdout.strip()) == tmp_path / "h" / "folder"
    assert any((tmp_path / "h" / "folder").rglob("*.txt"))


def test_cli_refuses_an_unknown_format(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["sample-data", "--out", str(tmp_path), "--format", "hostile"])
    assert result.exit_code == 2
    assert "webdataset, parquet, folder" in result.output
