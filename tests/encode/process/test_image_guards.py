"""Image guards hold before anything decodes (issue 14.7).

A small PNG that claims 20000 x 20000 pixels must be refused from its header: reading its EXIF first
decoded the whole image (+400 MB for this grayscale one; +2.3 GB for a 1.6 MB RGB one). Bytes of a
format the pipeline does not accept (EPS, whose plugin runs Ghostscript; PSD) are refused whatever
the member is called.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
from PIL import EpsImagePlugin

from encode.config import EncodeConfig, OutputConfig, SourceConfig
from encode.process.images import ImageRejected, decode_rgb, probe_size
from encode.process.prepare import select_sample
from encode.sample_data import encode_image
from encode.sources import RawSample

BOMB_SIDE = 20_000  # 400 M grayscale pixels: 400 MB once decoded, ~390 KB as a zlib-compressed PNG
# What selecting the bomb may add to the process's peak memory (the decoded image would add 400 MB).
MAX_PEAK_GROWTH_MB = 64
EPS_BODY = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 300 300\nnewpath 0 0 moveto showpage\n%%EOF\n"
PSD_BODY = b"8BPS\x00\x01" + b"\x00" * 64


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def decodable_bomb_png(side: int) -> bytes:
    """A valid grayscale PNG of side x side black pixels (compressed row by row: never held decoded)."""
    packer = zlib.compressobj(9)
    row = b"\x00" * (side + 1)  # filter byte + pixels
    idat = b"".join([packer.compress(row) for _ in range(side)] + [packer.flush()])
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def config() -> EncodeConfig:
    return EncodeConfig(source=SourceConfig(uri="unused"), output=OutputConfig(uri="unused"))


def sample(image: bytes) -> RawSample:
    return RawSample("k", image, "a red circle on a blue background", {"punsafe": 0.0, "pwatermark": 0.0})


PEAK_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    from tests.encode.process.test_image_guards import config, sample
    from encode.process.prepare import select_sample
    data = Path(sys.argv[1]).read_bytes()
    cfg = config()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reason = select_sample(sample(data), cfg)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(reason, (after - before) // 1024)
    """
)


@pytest.mark.slow
def test_pixel_bomb_is_refused_before_anything_decodes(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(decodable_bomb_png(BOMB_SIDE))
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(bomb)], cwd=root, capture_output=True, text=True, check=True
    )
    reason, growth_mb = done.stdout.split()
    assert reason == "decompression_bomb"
    assert int(growth_mb) < MAX_PEAK_GROWTH_MB, f"selecting the bomb grew peak memory by {growth_mb} MB"


@pytest.mark.parametrize(("body", "name"), [(EPS_BODY, "EPS"), (PSD_BODY, "PSD")])
def test_other_formats_named_jpg_are_refused_unopened(
    body: bytes, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[object] = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *args, **kwargs: ran.append(args))
    assert select_sample(sample(body), config()) == "unsupported_format"
    with pytest.raises(ImageRejected, match=name) as err:
        decode_rgb(body, max_pixels=1 << 30)
    assert err.value.reason == "unsupported_format"
    assert not ran, "Ghostscript was invoked"


def test_accepted_formats_still_open() -> None:
    from PIL import Image

    img = Image.new("RGB", (300, 280), (10, 200, 30))
    for fmt in ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"):
        assert probe_size(encode_image(img, fmt), max_pixels=300 * 280) == (300, 280)
    with pytest.raises(ImageRejected, match="decompression_bomb"):
        probe_size(encode_image(img, "PNG"), max_pixels=300 * 280 - 1)
