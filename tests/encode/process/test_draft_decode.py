"""JPEGs much larger than a resolution decode at a reduced DCT scale (issue 11 item 8.3).

`decode_rgb(min_side=...)` existed but nothing called it. Now `resize_for_resolutions` drafts a JPEG down
to no less than DRAFT_GAP x each resolution, per resolution, so what a resolution gets never depends on the
other resolutions; the result stays within 40 dB PSNR of resizing the full decode.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from encode.config import EncodeConfig
from encode.plan.fingerprints import EncoderIds, plan_partitions, stage_fingerprints
from encode.process.images import (
    DRAFT_GAP,
    decode_rgb,
    decoded_size,
    draft_side,
    resize_center_crop,
    resize_for_resolutions,
)
from encode.process.prepare import PreparedSample, prepare_partition
from encode.sample_data import build_webdataset
from encode.sources import list_partitions
from shared.config import load_config
from shared.manifest import Layout

MAX_PIXELS = 1 << 28
MIN_PSNR_DB = 40.0
RES = 64


def textured_jpeg(width: int, height: int, seed: int = 0) -> bytes:
    """Detail at every scale (sums of upsampled noise), like a photo's texture, saved at quality 90."""
    rng = np.random.default_rng(seed)
    img = np.zeros((height, width, 3))
    for octave in range(1, 7):
        small = rng.integers(0, 256, (2**octave, 2**octave, 3), dtype=np.uint8)
        img += np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC), float) / 1.6**octave
    img = (img - img.min()) / np.ptp(img) * 255
    buf = io.BytesIO()
    Image.fromarray(img.astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def full_decode_crop(data: bytes, res: int) -> np.ndarray:
    crop = resize_center_crop(decode_rgb(data, MAX_PIXELS), res, "bicubic")
    assert crop is not None
    return crop


def test_large_jpeg_decodes_at_a_reduced_scale_within_40_db() -> None:
    data = textured_jpeg(640, 480)  # 7.5x the resolution: libjpeg may scale by 1/2 (240 >= 2 x 64 + 1)
    width, height = decoded_size(data, MAX_PIXELS, draft_side(RES))
    assert (width, height) == (320, 240) and min(width, height) >= DRAFT_GAP * RES
    crop = resize_for_resolutions(data, MAX_PIXELS, [RES], "bicubic")[RES]
    assert crop is not None and crop.shape == (RES, RES, 3)
    reference = full_decode_crop(data, RES)
    assert not np.array_equal(crop, reference), "the crop came from a full decode"
    assert psnr(crop, reference) > MIN_PSNR_DB


def test_a_resolution_gets_the_same_pixels_whatever_else_is_configured() -> None:
    data = textured_jpeg(640, 480, seed=1)
    alone = resize_for_resolutions(data, MAX_PIXELS, [RES], "bicubic")
    with_big = resize_for_resolutions(data, MAX_PIXELS, [RES, 256], "bicubic")  # 256 needs the full decode
    assert np.array_equal(alone[RES], with_big[RES])  # type: ignore[arg-type]
    assert np.array_equal(with_big[256], full_decode_crop(data, 256))  # type: ignore[arg-type]


def test_small_jpegs_and_other_formats_decode_in_full() -> None:
    small = textured_jpeg(200, 150, seed=2)  # 150 < 2 x (2 x 64) + 1: no draft
    assert decoded_size(small, MAX_PIXELS, draft_side(RES)) == (200, 150)
    assert np.array_equal(
        resize_for_resolutions(small, MAX_PIXELS, [RES], "bicubic")[RES], full_decode_crop(small, RES)
    )  # type: ignore[arg-type]
    png = io.BytesIO()
    Image.open(io.BytesIO(textured_jpeg(640, 480))).save(png, "PNG")
    assert decoded_size(png.getvalue(), MAX_PIXELS, draft_side(RES)) == (640, 480)
    assert resize_for_resolutions(png.getvalue(), MAX_PIXELS, [1024], "bicubic") == {1024: None}


def test_encode_workers_use_draft_decoding(tmp_path: Path) -> None:
    build_webdataset(tmp_path / "wds", shards=1, per_shard=4, seed=7, size=(640, 480))
    cfg = load_config(
        EncodeConfig,
        "sample",
        [
            f"source.uri={tmp_path / 'wds'}",
            f"output.uri={tmp_path / 'out'}",
            f"transform.resolutions=[{RES}]",
        ],
        kind="datasets",
    )
    ids = EncoderIds(vae="v", text="t", tokenizer="k")
    (plan,) = plan_partitions(
        list_partitions(cfg.source), stage_fingerprints(cfg, ids), Layout(cfg.output.uri), {}
    )
    samples = [s for s in prepare_partition(plan, cfg) if isinstance(s, PreparedSample)]
    assert samples
    for sample in samples:
        data = _image_bytes(tmp_path / "wds", sample.key)
        assert np.array_equal(
            sample.pixels[RES], resize_for_resolutions(data, MAX_PIXELS, [RES], "bicubic")[RES]
        )  # type: ignore[arg-type]
        assert not np.array_equal(sample.pixels[RES], full_decode_crop(data, RES))
        assert psnr(sample.pixels[RES], full_decode_crop(data, RES)) > MIN_PSNR_DB


def _image_bytes(folder: Path, key: str) -> bytes:
    for tar in folder.glob("*.tar"):
        with tarfile.open(tar) as handle:
            for member in handle.getmembers():
                if member.name == f"{key}.jpg":
                    return handle.extractfile(member).read()  # type: ignore[union-attr]
    raise KeyError(key)
