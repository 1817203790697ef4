"""The bundled sample dataset: synthetic but real image files in real img2dataset layouts.

Nothing can be downloaded, so `make demo` and the tests build their data here, deterministically (fixed
seeds, fixed tar headers: identical bytes on every machine with the pinned Pillow/pyarrow). Each image is
one coloured shape on a contrasting background, and its caption says so ("a red circle on a blue
background"), so a model trained on it can be checked: samples for different prompts must differ the way
their captions say (`color_of_caption` parses a caption back, `COLORS` gives the RGB values). The shape
always covers the image centre and the background always fills the corners, whatever the size, position
jitter or crop.

`build_hostile_webdataset` writes one tar holding every kind of bad input next to good samples that must
survive, and returns how many of each to expect.

    python -m encode.sample_data --out DIR [--format webdataset|parquet|folder|hostile]
        -> DIR/webdataset (default: 4 x 128 samples), DIR/parquet, DIR/folder or DIR/hostile.tar
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import struct
import tarfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle")
# Every phrasing names the shape colour right before the shape and the background colour right before
# "background"/"backdrop", which is what `parse_caption` relies on.
CAPTION_TEMPLATES = (
    "a {fg} {shape} on a {bg} background",
    "{fg} {shape}, {bg} backdrop",
    "a {fg} {shape} against a {bg} background",
    "{bg} background with a {fg} {shape}",
    "photo of a {fg} {shape} on a plain {bg} background",
    "A {fg} {shape} in the middle of a {bg} backdrop.",
)
_COLOR_WORDS = "|".join(COLORS)
_SHAPE_PATTERN = re.compile(rf"\b({_COLOR_WORDS})\s+({'|'.join(SHAPES)})\b", re.IGNORECASE)
_BACKGROUND_PATTERN = re.compile(rf"\b({_COLOR_WORDS})\s+(?:background|backdrop)\b", re.IGNORECASE)

# Image sizes (shorter side in px): most can feed a 128 px model, some only 64 px, a few none at all, and
# a few are too elongated for the default aspect-ratio filter.
TINY_FRACTION, SMALL_FRACTION, WIDE_FRACTION = 0.05, 0.10, 0.05
TINY_SIDE = (24, 63)
SMALL_SIDE = (64, 127)
NORMAL_SIDE = (128, 288)
WIDE_SIDE = (128, 160)
WIDE_ASPECT = (2.2, 3.0)
NORMAL_ASPECT = (1.0, 1.6)
# Shape radius as a fraction of the shorter side, and the largest centre offset: the offset stays below
# the radius so the shape always covers the image centre, and radius + offset stays below 1/2 so the
# corners always show background.
RADIUS_FRACTION = (0.25, 0.36)
MAX_OFFSET_FRACTION = 0.12
NOISE_SIGMA = (2.0, 8.0)
JPEG_QUALITY = (70, 95)
# LAION-2B style scores: a few samples exceed the default filters (punsafe > 0.1, pwatermark > 0.5).
UNSAFE_FRACTION = 0.04
WATERMARK_FRACTION = 0.04
LOW_SIMILARITY_FRACTION = 0.03
NSFW_FRACTION, UNSURE_FRACTION = 0.03, 0.05
FAILED_DOWNLOAD_EVERY = 32  # img2dataset metadata also lists URLs it could not fetch
KEYS_PER_SHARD = 10_000  # img2dataset key = shard * 10^4 + index, 9 digits
PARQUET_ROW_GROUP = 16  # small row groups so readers really stream them
FOLDER_PNG_EVERY = 5
FOLDER_SUBDIR_EVERY = 4
FOLDER_JSON_EVERY = 3
TAR_MTIME = 1_700_000_000  # fixed header fields: identical tars on every machine
URL_BASE = "https://example.invalid/shapes"
# Hostile tar: good images are big enough for FilterConfig() defaults (min_size 256).
HOSTILE_GOOD_SIDE = 256
HUGE_SIZE = (4000, 3000)  # 12 MP: large but below the default max_pixels (8192^2)
BOMB_SIDE = 20_000  # a PNG header claiming 400 MP, backed by a few bytes


@dataclass(frozen=True)
class SampleSpec:
    """Everything that decides one synthetic sample."""

    fg: str
    bg: str
    shape: str
    width: int
    height: int
    caption: str


# --------------------------------------------------------------------------------- captions + parsing
def sample_captions() -> list[str]:
    """Fixed prompts for sample grids and for checking a trained model follows colour words."""
    return [
        "a red circle on a blue background",
        "a blue square on a yellow background",
        "a green triangle on a white background",
        "a yellow circle on a black background",
        "a white square on a red background",
        "a black triangle on a green background",
    ]


def parse_caption(caption: str) -> tuple[str, str, str] | None:
    """(shape colour, shape, background colour) named by a caption, or None if it names none."""
    shape = _SHAPE_PATTERN.search(caption)
    background = _BACKGROUND_PATTERN.search(caption)
    if not shape or not background:
        return None
    return shape.group(1).lower(), shape.group(2).lower(), background.group(1).lower()


def color_of_caption(caption: str) -> tuple[str, str] | None:
    """(shape colour, background colour) parsed back from a caption, e.g. for tests of generated images."""
    parsed = parse_caption(caption)
    return (parsed[0], parsed[2]) if parsed else None


# ---------------------------------------------------------------------------------------- rendering
def _uniform_int(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _pick_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): mostly >= 128 px, some 64-127, a few below 64, a few wider than 2:1."""
    roll = rng.random()
    if roll < TINY_FRACTION:
        short, aspect = _uniform_int(rng, TINY_SIDE), 1.0
    elif roll < TINY_FRACTION + SMALL_FRACTION:
        short, aspect = _uniform_int(rng, SMALL_SIDE), float(rng.uniform(*NORMAL_ASPECT))
    elif roll < TINY_FRACTION + SMALL_FRACTION + WIDE_FRACTION:
        short, aspect = _uniform_int(rng, WIDE_SIDE), float(rng.uniform(*WIDE_ASPECT))
    else:
        short, aspect = _uniform_int(rng, NORMAL_SIDE), float(rng.uniform(*NORMAL_ASPECT))
    long = round(short * aspect)
    return (long, short) if rng.random() < 0.5 else (short, long)


def _pick_spec(rng: np.random.Generator, size: tuple[int, int] | None = None) -> SampleSpec:
    names = list(COLORS)
    fg = names[int(rng.integers(len(names)))]
    bg = [n for n in names if n != fg][int(rng.integers(len(names) - 1))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    template = CAPTION_TEMPLATES[int(rng.integers(len(CAPTION_TEMPLATES)))]
    width, height = size or _pick_size(rng)
    return SampleSpec(fg, bg, shape, width, height, template.format(fg=fg, bg=bg, shape=shape))


def render(spec: SampleSpec, rng: np.random.Generator) -> Image.Image:
    """The spec's shape on its background, position/size jittered, with a little Gaussian noise."""
    img = Image.new("RGB", (spec.width, spec.height), COLORS[spec.bg])
    short = min(spec.width, spec.height)
    radius = short * float(rng.uniform(*RADIUS_FRACTION))
    cx = spec.width / 2 + short * float(rng.uniform(-MAX_OFFSET_FRACTION, MAX_OFFSET_FRACTION))
    cy = spec.height / 2 + short * float(rng.uniform(-MAX_OFFSET_FRACTION, MAX_OFFSET_FRACTION))
    _draw_shape(ImageDraw.Draw(img), spec.shape, cx, cy, radius, COLORS[spec.fg])
    sigma = float(rng.uniform(*NOISE_SIGMA))
    noisy = np.asarray(img, dtype=np.float32) + rng.normal(0.0, sigma, (spec.height, spec.width, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def _draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, color: tuple[int, int, int]
) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=color)
    elif shape == "square":
        half = r * 0.85  # about the circle's area, so shapes differ by outline, not by colour mass
        draw.rectangle((cx - half, cy - half, cx + half, cy + half), fill=color)
    else:  # an upward triangle with its centroid on (cx, cy)
        draw.polygon([(cx, cy - r), (cx - r * 0.87, cy + r * 0.5), (cx + r * 0.87, cy + r * 0.5)], fill=color)


def encode_image(img: Image.Image, fmt: str = "JPEG", **options: Any) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **options)
    return out.getvalue()


def _jpeg(img: Image.Image, rng: np.random.Generator) -> bytes:
    return encode_image(img, "JPEG", quality=_uniform_int(rng, JPEG_QUALITY))


# ------------------------------------------------------------------------------------------ metadata
def _laion_scores(rng: np.random.Generator) -> dict[str, float]:
    """punsafe / pwatermark / similarity like LAION-2B's, a few beyond the default thresholds."""
    unsafe = rng.random() < UNSAFE_FRACTION
    watermark = rng.random() < WATERMARK_FRACTION
    low_sim = rng.random() < LOW_SIMILARITY_FRACTION
    return {
        "punsafe": round(float(rng.uniform(0.2, 0.95) if unsafe else rng.uniform(0.0, 0.08)), 4),
        "pwatermark": round(float(rng.uniform(0.6, 0.98) if watermark else rng.uniform(0.0, 0.4)), 4),
        "similarity": round(float(rng.uniform(0.12, 0.2) if low_sim else rng.uniform(0.26, 0.4)), 4),
    }


def _nsfw_tag(rng: np.random.Generator) -> str:
    """A LAION-400M style `NSFW` column value."""
    roll = rng.random()
    return (
        "NSFW" if roll < NSFW_FRACTION else "UNSURE" if roll < NSFW_FRACTION + UNSURE_FRACTION else "UNLIKELY"
    )


def _success_meta(key: str, spec: SampleSpec, data: bytes, rng: np.random.Generator) -> dict[str, Any]:
    return {
        "key": key,
        "caption": spec.caption,
        "url": f"{URL_BASE}/{key}.jpg",
        "width": spec.width,
        "height": spec.height,
        "original_width": spec.width,
        "original_height": spec.height,
        "status": "success",
        "error_message": None,
        "exif": None,
        "sha256": hashlib.sha256(data).hexdigest(),
        **_laion_scores(rng),
    }


def _failed_meta(key: str, spec: SampleSpec) -> dict[str, Any]:
    return {
        "key": key,
        "caption": spec.caption,
        "url": f"{URL_BASE}/{key}.jpg",
        "width": None,
        "height": None,
        "original_width": None,
        "original_height": None,
        "status": "failed_to_download",
        "error_message": "HTTP Error 404: Not Found",
        "exif": None,
        "sha256": None,
        "punsafe": None,
        "pwatermark": None,
        "similarity": None,
    }


def _stats(shard: int, metas: list[dict[str, Any]]) -> dict[str, Any]:
    """img2dataset's {shard}_stats.json, with fixed times so the bytes are reproducible."""
    successes = sum(1 for m in metas if m["status"] == "success")
    failed = len(metas) - successes
    status_dict = {"success": successes, **({"HTTP Error 404: Not Found": failed} if failed else {})}
    return {
        "count": len(metas),
        "successes": successes,
        "failed_to_download": failed,
        "failed_to_resize": 0,
        "duration": 0.0,
        "start_time": 0.0,
        "end_time": 0.0,
        "status_dict": status_dict,
        "shard": f"{shard:05d}",
    }


def _key(shard: int, index: int) -> str:
    return f"{shard * KEYS_PER_SHARD + index:09d}"


@dataclass
class _Row:
    """One row of a shard: a rendered image (None: img2dataset failed to download it) and its metadata."""

    meta: dict[str, Any]
    image: bytes | None


def _shard_rows(
    shard: int,
    per_shard: int,
    seed: int,
    nsfw_column: bool = False,
    size: tuple[int, int] | None = None,
) -> list[_Row]:
    """`per_shard` successful samples plus a few failed downloads, interleaved like img2dataset's keys."""
    failures = per_shard // FAILED_DOWNLOAD_EVERY
    total = per_shard + failures
    picker = np.random.default_rng([seed, shard, total])
    failed = {int(i) for i in picker.choice(total, size=failures, replace=False)} if failures else set()
    rows = []
    for index in range(total):
        rng = np.random.default_rng([seed, shard, index])
        key, spec = _key(shard, index), _pick_spec(rng, size)
        if index in failed:
            rows.append(_Row(_failed_meta(key, spec), None))
            continue
        data = _jpeg(render(spec, rng), rng)
        meta = _success_meta(key, spec, data, rng)
        if nsfw_column:
            meta["NSFW"] = _nsfw_tag(rng)
        rows.append(_Row(meta, data))
    return rows


# --------------------------------------------------------------------------------------------- tars
def _tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), TAR_MTIME, 0o644
    tar.addfile(info, io.BytesIO(data))


def _sample_members(key: str, image: bytes, caption: bytes, meta: bytes, ext: str = "jpg") -> list[tuple]:
    """A sample's members in webdataset's TarWriter order (extensions sorted)."""
    return sorted([(f"{key}.{ext}", image), (f"{key}.json", meta), (f"{key}.txt", caption)])


def _write_tar(path: Path, members: Iterable[tuple[str, bytes]]) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            _tar_member(tar, name, data)
    path.write_bytes(buffer.getvalue())


def _write_parquet(path: Path, records: list[dict[str, Any]], row_group_size: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(dict.fromkeys(name for record in records for name in record))  # union, first-seen order
    table = pa.Table.from_pydict({name: [record.get(name) for record in records] for name in columns})
    pq.write_table(table, path, row_group_size=row_group_size)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=2).encode()


def build_webdataset(
    out_dir: Path,
    shards: int = 4,
    per_shard: int = 128,
    seed: int = 0,
    size: tuple[int, int] | None = None,
) -> list[Path]:
    """img2dataset webdataset output: {shard:05d}.tar ({key}.jpg/.json/.txt), .parquet and _stats.json.

    Each tar holds `per_shard` samples; the metadata parquet also lists a few failed downloads. Image
    sizes vary (tiny to wide) unless `size` = (width, height) fixes them, e.g. for benchmarks.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(shards):
        rows = _shard_rows(shard, per_shard, seed, size=size)
        members = []
        for row in rows:
            if row.image is not None:
                key = row.meta["key"]
                members += _sample_members(key, row.image, row.meta["caption"].encode(), _dumps(row.meta))
        tar_path = out_dir / f"{shard:05d}.tar"
        _write_tar(tar_path, members)
        _write_parquet(out_dir / f"{shard:05d}.parquet", [row.meta for row in rows], PARQUET_ROW_GROUP)
        (out_dir / f"{shard:05d}_stats.json").write_bytes(_dumps(_stats(shard, [r.meta for r in rows])))
        paths.append(tar_path)
    return paths


def build_parquet(out_dir: Path, shards: int = 2, per_shard: int = 64, seed: int = 1) -> list[Path]:
    """img2dataset parquet output: one row per URL (failed downloads have a null `jpg`), LAION-2B scores
    plus a LAION-400M `NSFW` column, written in small row groups."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(shards):
        rows = _shard_rows(shard, per_shard, seed, nsfw_column=True)
        records = [{**row.meta, "jpg": row.image} for row in rows]
        path = out_dir / f"{shard:05d}.parquet"
        _write_parquet(path, records, PARQUET_ROW_GROUP)
        (out_dir / f"{shard:05d}_stats.json").write_bytes(_dumps(_stats(shard, [r.meta for r in rows])))
        paths.append(path)
    return paths


def build_image_folder(out_dir: Path, count: int = 48, seed: int = 2) -> Path:
    """A folder of images with `{name}.txt` captions: mostly .jpg, some .png, some in a subfolder, and a
    `{name}.json` metadata sidecar for every third image."""
    out_dir = Path(out_dir)
    for index in range(count):
        rng = np.random.default_rng([seed, index])
        spec = _pick_spec(rng)
        folder = out_dir / "more" if index % FOLDER_SUBDIR_EVERY == FOLDER_SUBDIR_EVERY - 1 else out_dir
        folder.mkdir(parents=True, exist_ok=True)
        stem = folder / f"shapes_{index:04d}"
        img = render(spec, rng)
        if index % FOLDER_PNG_EVERY == FOLDER_PNG_EVERY - 1:
            data, ext = encode_image(img, "PNG"), "png"
        else:
            data, ext = _jpeg(img, rng), "jpg"
        stem.with_suffix(f".{ext}").write_bytes(data)
        stem.with_suffix(".txt").write_text(spec.caption + "\n", encoding="utf-8")
        if index % FOLDER_JSON_EVERY == 0:
            meta = {"caption": spec.caption, "width": spec.width, "height": spec.height, **_laion_scores(rng)}
            stem.with_suffix(".json").write_bytes(_dumps(meta))
    return out_dir


# ------------------------------------------------------------------------------------------ hostile
def _good_image(rng: np.random.Generator, side: int = HOSTILE_GOOD_SIDE) -> tuple[SampleSpec, Image.Image]:
    spec = _pick_spec(rng, size=(side + _uniform_int(rng, (0, 48)), side))
    return spec, render(spec, rng)


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return (
        struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    )


def decompression_bomb_png(side: int = BOMB_SIDE) -> bytes:
    """A ~100-byte PNG whose header claims side x side RGB pixels (never decode it)."""
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + _png_chunk(b"IEND", b"")
    )


def _exif_rotated_jpeg() -> bytes:
    """Stored 320x256 with its left half red and right half blue, EXIF orientation 6 (rotate 90 CW to
    display): displayed 256x320 with red on top. The test checks both the size and where red ends up."""
    stored = np.empty((HOSTILE_GOOD_SIDE, 320, 3), dtype=np.uint8)
    stored[:, :160] = COLORS["red"]
    stored[:, 160:] = COLORS["blue"]
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode_image(Image.fromarray(stored), "JPEG", quality=90, exif=exif.tobytes())


@dataclass
class HostileCase:
    """One hostile-tar entry: its members in tar order and what reading + filtering it must give."""

    key: str
    outcome: str  # "good" (kept), a reject reason, or UNCOUNTED
    members: list[tuple[str, bytes]]
    member_type: bytes = tarfile.REGTYPE  # SYMTYPE / DIRTYPE for the non-file cases


UNCOUNTED = "uncounted"  # a directory entry: skipped quietly, counted nowhere


def _sample_case(
    key: str,
    rng: np.random.Generator,
    outcome: str = "good",
    image: bytes | None = None,
    caption: bytes | None = None,
    meta: bytes | None = None,
    ext: str = "jpg",
) -> HostileCase:
    """A complete jpg/json/txt sample with a good 256+ px image unless a part is overridden."""
    spec, img = _good_image(rng)
    image = _jpeg(img, rng) if image is None else image
    caption = spec.caption.encode() if caption is None else caption
    if meta is None:
        meta = _dumps({"key": key, "caption": spec.caption, "width": spec.width, "height": spec.height})
    return HostileCase(key, outcome, _sample_members(key, image, caption, meta, ext))


def _bad_image_cases(rng: np.random.Generator) -> list[HostileCase]:
    noisy = np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    noisy_jpeg = encode_image(Image.fromarray(noisy), "JPEG", quality=90)
    _, big = _good_image(rng)
    return [
        _sample_case("01_zero_byte_image", rng, "empty_image_file", image=b""),
        _sample_case(
            "02_truncated_jpeg", rng, "truncated_image", image=noisy_jpeg[: len(noisy_jpeg) * 6 // 10]
        ),
        _sample_case(
            "03_not_an_image", rng, "decode_error", image=b"<html><body>404 Not Found</body></html>"
        ),
        HostileCase(
            "04_bomb",
            "decompression_bomb",
            [("04_bomb.png", decompression_bomb_png()), ("04_bomb.txt", b"a bomb")],
        ),
        _sample_case("05_tiny", rng, "too_small", image=_jpeg(big.resize((16, 16)), rng)),
        _sample_case("06_extreme_aspect", rng, "aspect_ratio", image=_jpeg(big.resize((1600, 256)), rng)),
        HostileCase(
            "07_missing_image",
            "missing_image",
            [("07_missing_image.json", b"{}"), ("07_missing_image.txt", b"x")],
        ),
    ]


def _bad_caption_and_meta_cases(rng: np.random.Generator) -> list[HostileCase]:
    _, big = _good_image(rng)
    return [
        HostileCase("10_missing_caption", "missing_caption", [("10_missing_caption.jpg", _jpeg(big, rng))]),
        _sample_case("11_empty_caption", rng, "empty_caption", caption=b"  \n\t "),
        _sample_case("12_caption_not_utf8", rng, "caption_not_utf8", caption=b"caf\xe9 \xff\xfe circle"),
        _sample_case("13_punsafe", rng, "punsafe", meta=_dumps({"punsafe": 0.93})),
        _sample_case("14_pwatermark", rng, "pwatermark", meta=_dumps({"PWATERMARK": 0.91})),
        _sample_case("15_nsfw", rng, "nsfw", meta=_dumps({"NSFW": "nsfw"})),
    ]


def _bad_member_cases(rng: np.random.Generator) -> list[HostileCase]:
    _, big = _good_image(rng)
    data = _jpeg(big, rng)
    return [
        HostileCase("20_dir", UNCOUNTED, [("20_dir", b"")], tarfile.DIRTYPE),
        HostileCase("../evil", "unsafe_member_name", [("../evil.jpg", data)]),
        HostileCase("/tmp/evil", "unsafe_member_name", [("/tmp/evil.jpg", data)]),
        HostileCase(
            "21_symlink", "unsafe_member_name", [("21_symlink.jpg", b"/etc/passwd")], tarfile.SYMTYPE
        ),
    ]


def _good_variant_cases(rng: np.random.Generator) -> list[HostileCase]:
    """Awkward but valid inputs that must all be kept (and decode to RGB)."""
    spec, img = _good_image(rng)
    rgba = img.convert("RGBA")
    rgba.putalpha(Image.new("L", img.size, 128))
    sixteen = np.asarray(img.convert("L"), dtype=np.uint16) * 257
    palette = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    huge = Image.new("RGB", HUGE_SIZE, COLORS["blue"])
    ImageDraw.Draw(huge).ellipse((1000, 500, 3000, 2500), fill=COLORS["yellow"])
    caption = spec.caption.encode()
    variants = [
        ("30_cmyk_jpeg", encode_image(img.convert("CMYK"), "JPEG", quality=90), "jpg"),
        ("31_rgba_png", encode_image(rgba, "PNG"), "png"),
        ("32_palette_png_transparent", encode_image(palette, "PNG", transparency=0), "png"),
        ("33_gray16_png", encode_image(Image.fromarray(sixteen), "PNG"), "png"),
        ("34_gray_png", encode_image(img.convert("L"), "PNG"), "png"),
        ("35_webp", encode_image(img, "WEBP", quality=80), "webp"),
        ("36_exif_rotated", _exif_rotated_jpeg(), "jpg"),
        ("37_huge_legal", encode_image(huge, "JPEG", quality=85), "jpg"),
    ]
    cases = [_sample_case(key, rng, image=data, caption=caption, ext=ext) for key, data, ext in variants]
    cases.append(_sample_case("38_bad_json", rng, meta=b'{"key": "38_bad_json", "width": '))
    cases.append(
        _sample_case(
            "39_html_caption", rng, caption=b"a red circle &amp;amp; friend\x07 on a blue background"
        )
    )
    return cases


def _interleave(good: list[HostileCase], bad: list[HostileCase]) -> list[HostileCase]:
    out: list[HostileCase] = []
    for index in range(max(len(good), len(bad))):
        out += good[index : index + 1] + bad[index : index + 1]
    return out


def hostile_cases() -> list[HostileCase]:
    """Every case of the hostile tar in tar order (deterministic)."""
    rng = np.random.default_rng(1234)
    bad = _bad_image_cases(rng) + _bad_caption_and_meta_cases(rng) + _bad_member_cases(rng)
    cases = [_sample_case("00_good", rng), *_interleave(_good_variant_cases(rng), bad)]
    cases.append(_sample_case("00_good", rng, "duplicate_key"))  # seen before, not adjacent: keep the first
    cases.append(_sample_case("99_truncated_last", rng, "corrupt_tar"))
    return cases


def _padded(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def build_hostile_webdataset(out_path: Path) -> dict[str, int]:
    """ONE tar mixing good samples with every hostile case, cut short inside its last member.

    Returns the expected outcome counts, {"good": n, reason: n, ...}, for reading it with a default
    SourceConfig and filtering/decoding with FilterConfig() defaults (good images are >= 256 px).
    """
    cases = hostile_cases()
    buffer = io.BytesIO()
    # Never closed on purpose: closing would write the end-of-archive blocks this tar must lack.
    tar = tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115
    last_data_start = last_size = 0
    for case in cases:
        for name, data in case.members:
            info = tarfile.TarInfo(name)
            info.mtime, info.mode, info.type = TAR_MTIME, 0o644, case.member_type
            if case.member_type == tarfile.SYMTYPE:
                info.linkname = data.decode()
                tar.addfile(info)
            elif case.member_type == tarfile.DIRTYPE:
                info.mode = 0o755
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                last_data_start, last_size = buffer.tell() - _padded(len(data)), len(data)
    # No tar.close(): the end-of-archive blocks never get written, and the last member is cut in half.
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(buffer.getvalue()[: last_data_start + max(last_size // 2, 1)])
    counts: dict[str, int] = {}
    for case in cases:
        if case.outcome != UNCOUNTED:
            counts[case.outcome] = counts.get(case.outcome, 0) + 1
    return counts


# ----------------------------------------------------------------------------------------------- CLI
BUILDERS = ("webdataset", "parquet", "folder", "hostile")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description="Build the bundled synthetic sample dataset.")
    parser.add_argument("--out", type=Path, required=True, help="root folder; data goes to OUT/<format>")
    parser.add_argument("--format", choices=BUILDERS, default="webdataset")
    parser.add_argument("--shards", type=int, default=None, help="webdataset/parquet: number of shards")
    parser.add_argument("--per-shard", type=int, default=None, help="webdataset/parquet: samples per shard")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    out = build(args.format, args.out, args.shards, args.per_shard, args.seed)
    print(out)
    return out


def build(fmt: str, root: Path, shards: int | None, per_shard: int | None, seed: int | None) -> Path:
    """Build one kind of sample data as `root/<fmt>` (hostile: `root/hostile.tar`), builder defaults where
    an option is None; return what a `source.uri` should point at."""
    options = {"shards": shards, "per_shard": per_shard, "seed": seed}
    given = {name: value for name, value in options.items() if value is not None}
    out = Path(root) / fmt
    if fmt == "webdataset":
        build_webdataset(out, **given)
    elif fmt == "parquet":
        build_parquet(out, **given)
    elif fmt == "folder":
        build_image_folder(out, **({"seed": given["seed"]} if "seed" in given else {}))
    else:
        out = Path(root) / "hostile.tar"
        build_hostile_webdataset(out)
    return out


if __name__ == "__main__":
    main()
