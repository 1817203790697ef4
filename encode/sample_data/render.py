"""The synthetic samples: a coloured shape on a contrasting background, its caption, and parsing it back."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
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
def uniform_int(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _pick_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): mostly >= 128 px, some 64-127, a few below 64, a few wider than 2:1."""
    roll = rng.random()
    if roll < TINY_FRACTION:
        short, aspect = uniform_int(rng, TINY_SIDE), 1.0
    elif roll < TINY_FRACTION + SMALL_FRACTION:
        short, aspect = uniform_int(rng, SMALL_SIDE), float(rng.uniform(*NORMAL_ASPECT))
    elif roll < TINY_FRACTION + SMALL_FRACTION + WIDE_FRACTION:
        short, aspect = uniform_int(rng, WIDE_SIDE), float(rng.uniform(*WIDE_ASPECT))
    else:
        short, aspect = uniform_int(rng, NORMAL_SIDE), float(rng.uniform(*NORMAL_ASPECT))
    long = round(short * aspect)
    return (long, short) if rng.random() < 0.5 else (short, long)


def pick_spec(rng: np.random.Generator, size: tuple[int, int] | None = None) -> SampleSpec:
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


def jpeg(img: Image.Image, rng: np.random.Generator) -> bytes:
    return encode_image(img, "JPEG", quality=uniform_int(rng, JPEG_QUALITY))
