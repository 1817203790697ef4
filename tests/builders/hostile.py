"""Hostile encode input for tests: one webdataset tar holding every kind of bad input next to good
samples that must survive; `build_hostile_webdataset` returns how many of each to expect."""

from __future__ import annotations

import io
import struct
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from encode.sample_data.layouts import json_bytes, sample_members
from encode.sample_data.render import (
    COLORS,
    TAR_MTIME,
    SampleSpec,
    encode_image,
    jpeg,
    pick_spec,
    render,
    uniform_int,
)

# Hostile tar: good images are big enough for FilterConfig() defaults (min_size 256).
HOSTILE_GOOD_SIDE = 256
HUGE_SIZE = (4000, 3000)  # 12 MP: large but below the default max_pixels (8192^2)
BOMB_SIDE = 20_000  # a PNG header claiming 400 MP, backed by a few bytes


# ------------------------------------------------------------------------------------------ hostile
def _good_image(rng: np.random.Generator, side: int = HOSTILE_GOOD_SIDE) -> tuple[SampleSpec, Image.Image]:
    spec = pick_spec(rng, size=(side + uniform_int(rng, (0, 48)), side))
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
    image = jpeg(img, rng) if image is None else image
    caption = spec.caption.encode() if caption is None else caption
    if meta is None:
        meta = json_bytes({"key": key, "caption": spec.caption, "width": spec.width, "height": spec.height})
    return HostileCase(key, outcome, sample_members(key, image, caption, meta, ext))


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
        _sample_case("05_tiny", rng, "too_small", image=jpeg(big.resize((16, 16)), rng)),
        _sample_case("06_extreme_aspect", rng, "aspect_ratio", image=jpeg(big.resize((1600, 256)), rng)),
        HostileCase(
            "07_missing_image",
            "missing_image",
            [("07_missing_image.json", b"{}"), ("07_missing_image.txt", b"x")],
        ),
    ]


def _bad_caption_and_meta_cases(rng: np.random.Generator) -> list[HostileCase]:
    _, big = _good_image(rng)
    return [
        HostileCase("10_missing_caption", "missing_caption", [("10_missing_caption.jpg", jpeg(big, rng))]),
        _sample_case("11_empty_caption", rng, "empty_caption", caption=b"  \n\t "),
        _sample_case("12_caption_not_utf8", rng, "caption_not_utf8", caption=b"caf\xe9 \xff\xfe circle"),
        _sample_case("13_punsafe", rng, "punsafe", meta=json_bytes({"punsafe": 0.93})),
        _sample_case("14_pwatermark", rng, "pwatermark", meta=json_bytes({"PWATERMARK": 0.91})),
        _sample_case("15_nsfw", rng, "nsfw", meta=json_bytes({"NSFW": "nsfw"})),
        # a member name that is not UTF-8 (latin-1 "café"): Python reads the byte as a surrogate
        _sample_case("16_caf\udce9", rng, "key_not_utf8"),
    ]


def _bad_member_cases(rng: np.random.Generator) -> list[HostileCase]:
    _, big = _good_image(rng)
    data = jpeg(big, rng)
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
