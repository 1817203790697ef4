"""Reference images for FID/KID: a folder, a webdataset tar (or a folder of them) or img2dataset parquet
shards, read in a fixed order (sorted names, then members in file order), each made RGB, resized on its
short side and centre-cropped to the generated size (as encode prepares training images).

Their Inception features are cached by content: the key hashes every selected image's bytes, the
Inception weights file's bytes and the size, so a second run on the same reference reads one file.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from shared.buckets import cover_box
from shared.config import ConfigError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
PARQUET_IMAGE_COLUMN = "jpg"  # img2dataset's output_format=parquet image column


def reference_bytes(source: str, limit: int) -> list[bytes]:
    """The encoded bytes of the first `limit` reference images (0: all) of a folder, tar or parquet."""
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"--reference {source} does not exist")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out: list[bytes] = []
    for item in _iter_images(files):
        out.append(item)
        if limit and len(out) >= limit:
            break
    if len(out) < 2:
        raise ConfigError(
            f"--reference {source} holds {len(out)} images; FID and KID need at least 2 (a folder of "
            f"{'/'.join(IMAGE_SUFFIXES)} files, webdataset .tar shards or img2dataset .parquet shards)"
        )
    return out


def _iter_images(files: list[Path]) -> Iterator[bytes]:
    for file in files:
        suffix = file.suffix.lower()
        if suffix in IMAGE_SUFFIXES:
            yield file.read_bytes()
        elif suffix == ".tar":
            yield from _tar_images(file)
        elif suffix == ".parquet":
            yield from _parquet_images(file)


def _tar_images(path: Path) -> Iterator[bytes]:
    with tarfile.open(path) as tar:
        for member in tar:
            if member.isfile() and os.path.splitext(member.name)[1].lower() in IMAGE_SUFFIXES:
                handle = tar.extractfile(member)
                if handle is not None:
                    yield handle.read()


def _parquet_images(path: Path) -> Iterator[bytes]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if PARQUET_IMAGE_COLUMN not in table.column_names:
        raise ConfigError(f"{path} has no {PARQUET_IMAGE_COLUMN!r} column (img2dataset parquet output)")
    for value in table.column(PARQUET_IMAGE_COLUMN).to_pylist():
        if value:
            yield value


def decode_resized(data: bytes, size: int | tuple[int, int]) -> torch.Tensor:
    """uint8 [3, size, size]: RGB, short side resized to `size` (bicubic), centre crop. A (height, width)
    size (eval-images --size, a bucket): resized to cover it, centre crop, as encode's buckets do."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    if isinstance(size, tuple):
        box = cover_box(image.width, image.height, size) or (0, 0, image.width, image.height)
        image = image.resize((size[1], size[0]), Image.BICUBIC, box=box)
        return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)
    width, height = image.size
    scale = size / min(width, height)
    image = image.resize((max(size, round(width * scale)), max(size, round(height * scale))), Image.BICUBIC)
    left, top = (image.width - size) // 2, (image.height - size) // 2
    image = image.crop((left, top, left + size, top + size))
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


def content_key(images: list[bytes], weights_path: str, size: int | tuple[int, int]) -> str:
    name = f"{size[0]}x{size[1]}" if isinstance(size, tuple) else str(size)  # a square keeps its old key
    digest = hashlib.sha256(f"reference-v1:{name}:".encode())
    digest.update(hashlib.sha256(Path(weights_path).read_bytes()).digest())
    for data in images:
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()[:32]


def reference_features(
    source: str, limit: int, size: int | tuple[int, int], weights_path: str, extract, cache_dir: str
) -> tuple[torch.Tensor, bool]:
    """([N, F] float64 Inception features of the reference, whether they came from the cache)."""
    images = reference_bytes(source, limit)
    path = Path(cache_dir) / f"reference-{content_key(images, weights_path, size)}.pt"
    if path.exists():
        log.info("reference features from cache %s", path)
        return torch.load(path, weights_only=True), True
    features = extract(torch.stack([decode_resized(data, size) for data in images]))
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(features, scratch)
    os.replace(scratch, path)  # atomic: a concurrent run never reads half a file
    log.info("cached reference features of %d images in %s", len(images), path)
    return features, False
