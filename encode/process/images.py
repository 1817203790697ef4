"""Decode an image once, fix orientation and mode, then resize + center-crop it at every resolution (or,
with aspect-ratio buckets, resize it to cover its bucket and centre-crop the overhang: `resize_cover`).

Orchestration: `probe_size` (header only) feeds the size filters; `decode_rgb` decodes survivors once;
`resize_center_crop` is then called for each configured resolution *from the decoded image*, not from the
previous (larger) result: every output is resampled exactly once from the original pixels, and since the
crop box is applied inside the resize, no call touches pixels outside its central square anyway.

PIL's own decompression-bomb guard is replaced by ours (`max_pixels`, checked from the header before any
pixel is decoded, EXIF included: for PNG, reading EXIF decodes the whole image): PIL's limit is a
process-wide setting that warns at one size and raises at another, neither of which is the configured one.

Only `ACCEPTED_FORMATS` are ever opened: whatever a member is named, bytes of another format (EPS, whose
plugin runs Ghostscript; PSD; ...) are refused as "unsupported_format" without reaching their plugin.
"""

from __future__ import annotations

import contextlib
import io
import math
import threading
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
from PIL import Image

from shared.buckets import Bucket, cover_box

EXIF_ORIENTATION_TAG = 0x0112
# EXIF orientations 5-8 store the image rotated by 90 degrees: width and height swap on display.
SWAPPING_ORIENTATIONS = (5, 6, 7, 8)
ORIENTATION_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
RESAMPLE = {
    "lanczos": Image.Resampling.LANCZOS,
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "area": Image.Resampling.BOX,
}
# Pillow's resize is a true antialiased convolution (its filter widens with the downscale factor). With
# reducing_gap it first shrinks by an integer factor with a box filter, then resamples the rest: a large
# speed-up on big photos, and at 3.0 the result is indistinguishable from the slow path (Pillow docs).
REDUCING_GAP = 3.0
# JPEG draft decoding (libjpeg DCT scaling by 1/2, 1/4, 1/8) keeps the shorter side >= DRAFT_GAP x the
# resolution, so the resize after it still antialiases over a >= 2x reduction (Pillow's `thumbnail` uses
# the same gap). Measured on the sample data's sharp-edged shapes: drafting down to 1x the resolution
# costs up to 10 dB of PSNR against the full decode; at 2x it stays above 40 dB.
DRAFT_GAP = 2.0
WHITE = (255, 255, 255)
UINT8_MAX = 255
UINT16_MAX = 65535
ALPHA_MODES = ("RGBA", "LA", "PA", "La", "RGBa")
HIGH_BIT_MODES = ("I", "F")  # 32-bit int / float grayscale (TIFF, some PNG/PGM via I;16 -> I)
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")

# The web image formats the pipeline decodes (the JPEG plugin also opens multi-picture MPO files).
ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
SNIFF_BYTES = 32  # enough for every Pillow plugin's magic-number check

_pil_guard_lock = threading.Lock()
_pil_guard_users = 0
_pil_guard_saved: int | None = None


class ImageRejected(Exception):
    """An image that cannot become a training sample; `reason` is the snake_case count key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason, detail)  # args round-trip through pickle into worker results
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


@contextlib.contextmanager
def _own_bomb_check() -> Iterator[None]:
    """Switch PIL's pixel limit off while we use PIL (we check `max_pixels` ourselves before decoding).

    Reference-counted under a lock so concurrent threads restore the process's original limit exactly
    once, after the last of them is done.
    """
    global _pil_guard_users, _pil_guard_saved
    with _pil_guard_lock:
        if _pil_guard_users == 0:
            _pil_guard_saved = Image.MAX_IMAGE_PIXELS
            Image.MAX_IMAGE_PIXELS = None
        _pil_guard_users += 1
    try:
        yield
    finally:
        with _pil_guard_lock:
            _pil_guard_users -= 1
            if _pil_guard_users == 0:
                Image.MAX_IMAGE_PIXELS = _pil_guard_saved


def _open(data: bytes, max_pixels: int | None) -> Image.Image:
    """Parse the header only (PIL decodes lazily) of an accepted format, refusing a pixel bomb from it.

    Bytes of a format outside ACCEPTED_FORMATS are "unsupported_format"; anything else unreadable is a
    decode_error.
    """
    try:
        img = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except Exception as err:  # UnidentifiedImageError, SyntaxError, struct.error, ... from any plugin
        found = sniff_format(data)
        if found is not None and found not in ACCEPTED_FORMATS:
            raise ImageRejected("unsupported_format", f"{found} data (accepted: {ACCEPTED_FORMATS})") from err
        raise ImageRejected("decode_error", str(err)) from err
    width, height = img.size
    if max_pixels is not None and width * height > max_pixels:
        raise ImageRejected("decompression_bomb", f"{width}x{height} > max_pixels {max_pixels}")
    return img


def sniff_format(data: bytes) -> str | None:
    """The Pillow format whose magic number `data` starts with (no plugin parses anything), or None."""
    Image.init()
    prefix = data[:SNIFF_BYTES]
    for name, (_, accept) in Image.OPEN.items():
        with contextlib.suppress(Exception):
            if accept is not None and accept(prefix):
                return name
    return None


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation (1 when absent or unreadable: broken EXIF must not sink good pixels)."""
    try:
        value = img.getexif().get(EXIF_ORIENTATION_TAG, 1)
        return int(value) if int(value) in ORIENTATION_TRANSPOSE else 1
    except Exception:
        return 1


def probe_size(data: bytes, max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) as displayed. More than `max_pixels` is refused from the header alone, before
    anything decodes; only then is EXIF read (for PNG that decodes the image), so bombs stay cheap."""
    with _own_bomb_check():
        img = _open(data, max_pixels)
        width, height = img.size
        if _orientation(img) in SWAPPING_ORIENTATIONS:
            width, height = height, width
    if width < 1 or height < 1:
        raise ImageRejected("decode_error", f"header claims a {width}x{height} image")
    return width, height


def decode_rgb(data: bytes, max_pixels: int, min_side: int | None = None) -> Image.Image:
    """Fully decode to an upright 8-bit RGB image, refusing more than `max_pixels` before decoding.

    `min_side`: let JPEG decode at a reduced scale (libjpeg DCT scaling, 1/2 to 1/8) as long as the shorter
    side stays >= min_side; pass the largest resolution to skip decoding pixels every resize throws away.
    """
    with _own_bomb_check():
        img = _open(data, max_pixels)
        if min_side is not None and img.format == "JPEG":
            _draft_for(img, min_side)
        _load(img)
    img = _upright(img)
    return to_rgb(img)


def _draft_for(img: Image.Image, min_side: int) -> None:
    """Ask libjpeg for the smallest DCT scale whose shorter side is still >= min_side."""
    width, height = img.size
    short = min(width, height)
    if short <= min_side:
        return
    scale = min_side / short
    with contextlib.suppress(Exception):  # drafting is an optimisation only
        img.draft(img.mode, (max(1, int(width * scale + 1)), max(1, int(height * scale + 1))))


def decoded_size(data: bytes, max_pixels: int, min_side: int | None) -> tuple[int, int]:
    """The stored size `decode_rgb(data, max_pixels, min_side)` decodes at (the JPEG draft scale applied),
    from the header alone."""
    with _own_bomb_check():
        img = _open(data, max_pixels)
        if min_side is not None and img.format == "JPEG":
            _draft_for(img, min_side)
        return img.size


def resize_for_resolutions(
    data: bytes,
    max_pixels: int,
    resolutions: Sequence[int],
    resample: str,
    buckets: Mapping[int, Bucket] | None = None,
) -> dict[int, np.ndarray | None]:
    """`resize_center_crop` of the image at every resolution (None: smaller than it), decoding as little
    as each needs; a resolution in `buckets` is resized to cover its bucket instead (`resize_cover`).

    A JPEG at least 2x a resolution decodes at a reduced DCT scale chosen for that resolution alone
    (`decode_rgb(min_side=resolution)`), so a resolution's pixels never depend on which other resolutions
    are configured or reused; resolutions that get the same scale share one decode.
    """
    buckets = buckets or {}
    sides = {res: draft_side(max(buckets[res]) if res in buckets else res) for res in resolutions}
    by_size: dict[tuple[int, int], list[int]] = {}
    for res in resolutions:
        by_size.setdefault(decoded_size(data, max_pixels, sides[res]), []).append(res)
    out: dict[int, np.ndarray | None] = {}
    for group in by_size.values():
        image = decode_rgb(data, max_pixels, min_side=sides[group[0]])
        for res in group:
            if res in buckets:
                out[res] = resize_cover(image, buckets[res], resample)
            else:
                out[res] = resize_center_crop(image, res, resample)
    return out


def resize_cover(img: Image.Image, bucket: Bucket, resample: str) -> np.ndarray | None:
    """uint8 HWC RGB at the bucket's (height, width): the image scaled to cover it, centre-cropped by the
    least amount (shared/buckets.py `cover_box`), in one resample. None when covering needs an upscale.

    A drafted JPEG is smaller than the original; the box is proportional, so the pixels kept are the same.
    """
    if resample not in RESAMPLE:
        raise ValueError(f"unknown resample {resample!r}; use one of {', '.join(RESAMPLE)}")
    if img.mode != "RGB":
        img = to_rgb(img)
    width, height = img.size
    box = cover_box(width, height, bucket)
    if box is None:
        return None
    bucket_h, bucket_w = bucket
    gap = REDUCING_GAP if (box[2] - box[0]) > bucket_w else None
    out = img.resize((bucket_w, bucket_h), RESAMPLE[resample], box=box, reducing_gap=gap)
    return np.ascontiguousarray(np.asarray(out, dtype=np.uint8))


def draft_side(resolution: int) -> int:
    """The shorter side a JPEG may be drafted down to for `resolution`: DRAFT_GAP times it."""
    return math.ceil(DRAFT_GAP * resolution)


def _load(img: Image.Image) -> None:
    try:
        img.load()
    except OSError as err:
        reason = "truncated_image" if "truncated" in str(err).lower() else "decode_error"
        raise ImageRejected(reason, str(err)) from err
    except Exception as err:  # SyntaxError, ValueError, EOFError, struct.error, MemoryError, ...
        raise ImageRejected("decode_error", str(err)) from err


def _upright(img: Image.Image) -> Image.Image:
    orientation = _orientation(img)
    if orientation == 1:
        return img
    return img.transpose(ORIENTATION_TRANSPOSE[orientation])


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> 8-bit RGB: alpha composited over white, 16-bit/float scaled, CMYK/P/L/1 converted."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode == "P" and "transparency" in img.info:
        return _over_white(img.convert("RGBA"))
    if mode in ALPHA_MODES:
        return _over_white(img.convert("RGBA"))
    if mode in SIXTEEN_BIT_MODES or mode in HIGH_BIT_MODES:
        return Image.fromarray(_high_bit_to_uint8(np.asarray(img))).convert("RGB")
    try:
        return img.convert("RGB")  # L, 1, P, CMYK (Adobe inversion handled by the JPEG plugin), YCbCr, ...
    except (ValueError, OSError) as err:
        raise ImageRejected("unsupported_mode", f"cannot convert mode {mode} to RGB") from err


def _over_white(rgba: Image.Image) -> Image.Image:
    """Transparent areas become white (a black fill would teach the model black borders on logos)."""
    background = Image.new("RGBA", rgba.size, (*WHITE, UINT8_MAX))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _high_bit_to_uint8(values: np.ndarray) -> np.ndarray:
    """Scale grayscale data to 0..255 by the range its type implies, not by truncating high bytes.

    16-bit data divides by 257 (65535 -> 255 exactly); 32-bit int or float data holding 8- or 16-bit
    values is scaled as such; floats in [0, 1] are scaled by 255; anything else is min-max normalised.
    """
    data = values.astype(np.float64)
    if not np.isfinite(data).all():
        data = np.nan_to_num(data, nan=0.0, posinf=0.0, neginf=0.0)
    low, high = float(data.min()), float(data.max())
    if values.dtype.kind == "f" and low >= 0.0 and high <= 1.0:
        scaled = data * UINT8_MAX
    elif low >= 0 and high <= UINT8_MAX and values.dtype.kind != "u":
        scaled = data
    elif low >= 0 and high <= UINT16_MAX:
        scaled = data / (UINT16_MAX / UINT8_MAX)
    else:
        scaled = (data - low) / max(high - low, 1e-12) * UINT8_MAX
    return np.clip(np.rint(scaled), 0, UINT8_MAX).astype(np.uint8)


def crop_box(width: int, height: int) -> tuple[float, float, float, float]:
    """The central square of a width x height image (left, top, right, bottom)."""
    side = min(width, height)
    left, top = (width - side) / 2, (height - side) / 2
    return (left, top, left + side, top + side)


def resize_center_crop(img: Image.Image, resolution: int, resample: str) -> np.ndarray | None:
    """uint8 HWC RGB, resolution x resolution: shorter side resized to `resolution`, then center-cropped.

    None when the shorter side is below `resolution` (never upscale). Cropping the central square and
    resizing it in one call (Pillow's `box`) equals resize-then-crop without resampling discarded pixels.
    """
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    if resample not in RESAMPLE:
        raise ValueError(f"unknown resample {resample!r}; use one of {', '.join(RESAMPLE)}")
    if img.mode != "RGB":
        img = to_rgb(img)
    width, height = img.size
    if min(width, height) < resolution:
        return None
    box = crop_box(width, height)
    gap = REDUCING_GAP if min(width, height) > resolution else None
    out = img.resize((resolution, resolution), RESAMPLE[resample], box=box, reducing_gap=gap)
    return np.ascontiguousarray(np.asarray(out, dtype=np.uint8))


def to_model_input(pixels: np.ndarray) -> np.ndarray:
    """uint8 HWC RGB -> float32 CHW in [-1, 1], what the SD VAE encoder expects."""
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"expected uint8 HxWx3 RGB pixels, got {pixels.dtype} {pixels.shape}")
    scaled = pixels.astype(np.float32) / (UINT8_MAX / 2.0) - 1.0
    return np.ascontiguousarray(scaled.transpose(2, 0, 1))
