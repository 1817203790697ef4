"""encode.process.images: header probing, decoding every mode to upright RGB, resize + center-crop, model
input."""

from __future__ import annotations

import pickle
import time
import warnings

import numpy as np
import pytest
from PIL import Image

from encode.process.images import (
    ImageRejected,
    decode_rgb,
    probe_size,
    resize_center_crop,
    to_model_input,
    to_rgb,
)
from encode.sample_data import COLORS, encode_image
from tests.builders.hostile import decompression_bomb_png

MAX_PIXELS = 8192 * 8192


def solid(size: tuple[int, int], color: tuple[int, ...], mode: str = "RGB") -> Image.Image:
    return Image.new(mode, size, color)


def exif_jpeg(orientation: int) -> bytes:
    """Stored 40x20: left half red, right half blue."""
    stored = np.zeros((20, 40, 3), dtype=np.uint8)
    stored[:, :20] = COLORS["red"]
    stored[:, 20:] = COLORS["blue"]
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode_image(Image.fromarray(stored), "JPEG", quality=95, exif=exif.tobytes())


def near(pixel: np.ndarray, color: tuple[int, int, int], tol: int = 25) -> bool:
    return bool(np.abs(pixel.astype(int) - np.array(color)).max() <= tol)


# ---------------------------------------------------------------------------------------------- probe
def test_probe_size_reads_the_header_and_honours_exif() -> None:
    assert probe_size(encode_image(solid((30, 20), (1, 2, 3)), "PNG")) == (30, 20)
    assert probe_size(exif_jpeg(1)) == (40, 20)
    assert probe_size(exif_jpeg(6)) == (20, 40)
    assert probe_size(exif_jpeg(3)) == (40, 20)


def test_probe_size_of_a_bomb_is_cheap_and_leaks_no_pil_warning() -> None:
    limit = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a DecompressionBombWarning would raise here
        started = time.perf_counter()
        assert probe_size(decompression_bomb_png(20_000)) == (20_000, 20_000)
        assert time.perf_counter() - started < 1.0
    assert limit == Image.MAX_IMAGE_PIXELS  # PIL's process-wide setting is restored


@pytest.mark.parametrize("data", [b"", b"<html>nope</html>", b"\x89PNG\r\n\x1a\n" + b"\x00" * 30])
def test_probe_size_rejects_non_images(data: bytes) -> None:
    with pytest.raises(ImageRejected) as info:
        probe_size(data)
    assert info.value.reason == "decode_error"


# --------------------------------------------------------------------------------------------- decode
def test_decode_rejects_bombs_before_decoding() -> None:
    started = time.perf_counter()
    with pytest.raises(ImageRejected) as info:
        decode_rgb(decompression_bomb_png(20_000), MAX_PIXELS)
    assert info.value.reason == "decompression_bomb" and time.perf_counter() - started < 1.0
    with pytest.raises(ImageRejected, match="decompression_bomb"):
        decode_rgb(encode_image(solid((100, 100), (0, 0, 0)), "PNG"), max_pixels=99 * 100)


def test_decode_truncated_jpeg() -> None:
    noise = np.random.default_rng(0).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    data = encode_image(Image.fromarray(noise), "JPEG", quality=90)
    with pytest.raises(ImageRejected) as info:
        decode_rgb(data[: len(data) * 6 // 10], MAX_PIXELS)
    assert info.value.reason == "truncated_image"


def test_decode_applies_exif_rotation() -> None:
    img = decode_rgb(exif_jpeg(6), MAX_PIXELS)  # rotate 90 degrees clockwise to display
    pixels = np.asarray(img)
    assert img.size == (20, 40) and img.mode == "RGB"
    assert near(pixels[5, 10], COLORS["red"]) and near(pixels[35, 10], COLORS["blue"])
    flipped = np.asarray(decode_rgb(exif_jpeg(2), MAX_PIXELS))  # mirrored: red on the right
    assert near(flipped[10, 35], COLORS["red"])


def rgb_of(img: Image.Image, fmt: str = "PNG", **options: object) -> np.ndarray:
    out = decode_rgb(encode_image(img, fmt, **options), MAX_PIXELS)
    assert out.mode == "RGB"
    return np.asarray(out)


def test_decode_alpha_and_palette_composite_over_white() -> None:
    transparent = rgb_of(solid((8, 8), (200, 0, 0, 0), "RGBA"))
    assert (transparent == 255).all()
    half = rgb_of(solid((8, 8), (0, 0, 0, 128), "RGBA"))
    assert abs(int(half[0, 0, 0]) - 127) <= 2
    assert (rgb_of(solid((8, 8), (0, 0), "LA")) == 255).all()
    palette = solid((8, 8), (10, 200, 10)).convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    assert (rgb_of(palette, transparency=palette.getpixel((0, 0))) == 255).all()
    assert near(rgb_of(palette)[0, 0], (10, 200, 10), tol=3)


def test_decode_sixteen_bit_scales_instead_of_clipping() -> None:
    ramp = np.array([[0, 257 * 128, 65535]], dtype=np.uint16)
    out = rgb_of(Image.fromarray(ramp))
    assert out[0, :, 0].tolist() == [0, 128, 255] and (out[..., 0] == out[..., 2]).all()


def test_to_rgb_handles_int_float_cmyk_and_bilevel() -> None:
    as_int = Image.fromarray(np.array([[0, 100, 255]], dtype=np.int32))
    assert np.asarray(to_rgb(as_int))[0, :, 1].tolist() == [0, 100, 255]  # 8-bit values kept as-is
    wide = Image.fromarray(np.array([[0, 65535]], dtype=np.int32))
    assert np.asarray(to_rgb(wide))[0, :, 0].tolist() == [0, 255]
    unit = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))
    assert np.asarray(to_rgb(unit))[0, :, 0].tolist() == [0, 128, 255]
    assert near(rgb_of(solid((8, 8), COLORS["red"]).convert("CMYK"), "JPEG", quality=95)[4, 4], COLORS["red"])
    assert (rgb_of(solid((8, 8), 1, "1")) == 255).all()
    assert (rgb_of(solid((8, 8), 7, "L")) == 7).all()


def test_decode_with_min_side_drafts_jpeg_at_reduced_scale() -> None:
    rng = np.random.default_rng(1)
    big = Image.fromarray(np.kron(rng.integers(0, 256, (24, 32, 3)), np.ones((32, 32, 1))).astype(np.uint8))
    data = encode_image(big, "JPEG", quality=95)  # 1024 x 768
    full = decode_rgb(data, MAX_PIXELS)
    drafted = decode_rgb(data, MAX_PIXELS, min_side=128)
    assert full.size == (1024, 768) and min(drafted.size) >= 128 and drafted.size[0] < 1024
    a = resize_center_crop(full, 128, "bicubic").astype(int)  # type: ignore[union-attr]
    b = resize_center_crop(drafted, 128, "bicubic").astype(int)  # type: ignore[union-attr]
    assert np.abs(a - b).mean() < 4


def test_image_rejected_pickles() -> None:
    err = pickle.loads(pickle.dumps(ImageRejected("truncated_image", "image file is truncated")))
    assert err.reason == "truncated_image" and str(err) == "truncated_image: image file is truncated"


# ------------------------------------------------------------------------------------- resize + crop
def test_resize_never_upscales() -> None:
    assert resize_center_crop(solid((300, 255), (0, 0, 0)), 256, "bicubic") is None


def test_resize_same_size_is_exact() -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    out = resize_center_crop(Image.fromarray(pixels), 64, "lanczos")
    assert out is not None and np.array_equal(out, pixels)


@pytest.mark.parametrize("resample", ["lanczos", "bicubic", "bilinear", "area"])
@pytest.mark.parametrize("landscape", [True, False])
def test_resize_center_crops_the_middle(resample: str, landscape: bool) -> None:
    bands = np.zeros((120, 360, 3), dtype=np.uint8)  # red | blue | green thirds
    bands[:, :120], bands[:, 120:240], bands[:, 240:] = COLORS["red"], COLORS["blue"], COLORS["green"]
    img = Image.fromarray(bands if landscape else bands.transpose(1, 0, 2).copy())
    out = resize_center_crop(img, 64, resample)
    assert out is not None and out.shape == (64, 64, 3) and out.dtype == np.uint8
    # the filter reaches a pixel or two past the crop, exactly as resize-then-crop would
    inner = out[3:-3, 3:-3].astype(int)
    assert np.abs(inner - np.array(COLORS["blue"])).max() <= 2


def test_resize_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown resample"):
        resize_center_crop(solid((8, 8), (0, 0, 0)), 8, "nearest-ish")
    rgba = resize_center_crop(solid((8, 8), (0, 0, 0, 0), "RGBA"), 4, "bicubic")
    assert rgba is not None and rgba.shape == (4, 4, 3)


def test_to_model_input_range_and_layout() -> None:
    pixels = np.zeros((4, 6, 3), dtype=np.uint8)
    pixels[..., 0] = 255
    out = to_model_input(pixels)
    assert out.shape == (3, 4, 6) and out.dtype == np.float32 and out.flags["C_CONTIGUOUS"]
    assert (out[0] == 1.0).all() and (out[1:] == -1.0).all()
    with pytest.raises(ValueError, match="uint8"):
        to_model_input(pixels.astype(np.float32))
