"""The records every source reader yields (Partition, RawSample, Rejected) and checks all formats share."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shared import storage
from shared.manifest import fingerprint

WEBDATASET = "webdataset"
PARQUET = "parquet"
FOLDER = "folder"
# A member or file bigger than this is rejected unread ("file_too_large"): a hostile tar header can claim
# terabytes, and real web images are a few MB (the decompression-bomb check handles pixel counts).
MAX_MEMBER_BYTES = 1 << 28


class SourceError(ValueError):
    """The input does not fit the source config (wrong format, missing column); the message names the fix."""


@dataclass(frozen=True)
class Partition:
    """One input shard (or one folder bucket): the unit of work and of resumability."""

    # Stable, filesystem/S3-safe and unique in the dataset: "00000.tar" -> "00000-tar",
    # "a/b/00001.parquet" -> "a-b-00001-parquet", folder buckets "folder-0007".
    id: str
    kind: str  # "webdataset" | "parquet" | "folder"
    # The input file(s): one tar/parquet; for a folder bucket its image files, in key order.
    uris: tuple[str, ...]
    # folder: the folder the keys are relative to; other kinds: the dataset root the id was derived from.
    root: str = ""
    # folder: the caption/metadata sidecar files that exist for the bucket's images (part of the input).
    sidecars: tuple[str, ...] = ()
    # size + version of every file in `uris` and `sidecars` as listed (saves a stat per file); empty:
    # `source_fingerprint` stats them.
    listed: tuple[storage.FileInfo, ...] = field(default=(), compare=False, repr=False)

    def files(self) -> tuple[str, ...]:
        """Every input file whose bytes this partition's samples come from."""
        return self.uris + self.sidecars

    def source_fingerprint(self) -> str:
        """Identity of the input bytes: uri + size + version of every file; a changed file changes it."""
        known = {info.uri: info for info in self.listed}
        infos = [known.get(uri) or storage.stat(uri) for uri in self.files()]
        return fingerprint([self.kind, [[info.uri, info.size, info.version] for info in infos]])


@dataclass
class RawSample:
    key: str  # img2dataset key / parquet key column / folder: path relative to the root without extension
    image: bytes | None
    caption: str | None  # decoded UTF-8, raw (not cleaned)
    meta: dict[str, Any]  # metadata as read: img2dataset .json fields, parquet columns except the image


@dataclass
class Rejected:
    key: str | None
    reason: str  # short snake_case reason, e.g. "missing_image", "corrupt_tar", "duplicate_key"
    count: int = 1  # e.g. a corrupt parquet row group: the rows that could not be read


def make_sample(
    key: str, image: bytes | None, caption: bytes | str | None, meta: dict[str, Any]
) -> RawSample | Rejected:
    """The checks every format shares: an image with bytes and a caption that is text."""
    if image is None:
        return Rejected(key, "missing_image")
    if len(image) == 0:
        return Rejected(key, "empty_image_file")
    if caption is None:
        return Rejected(key, "missing_caption")
    if isinstance(caption, bytes):
        try:
            caption = caption.decode("utf-8")
        except UnicodeDecodeError:
            return Rejected(key, "caption_not_utf8")
    return RawSample(key=key, image=image, caption=caption, meta=meta)


def parse_json(data: bytes | None) -> dict[str, Any]:
    """img2dataset metadata; unreadable or not an object -> {} (the sample itself is still good)."""
    if not data:
        return {}
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def count_by_reason(items: Iterable[RawSample | Rejected]) -> dict[str, int]:
    """{"good": n, reason: n, ...} over what `read_partition` yielded (for reports and tests)."""
    counts: dict[str, int] = {}
    for item in items:
        name = item.reason if isinstance(item, Rejected) else "good"
        counts[name] = counts.get(name, 0) + (item.count if isinstance(item, Rejected) else 1)
    return counts
