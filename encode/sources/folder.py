"""A folder of images with `{stem}.txt` captions (and optional `{stem}.json`), one hash bucket at a time."""

from __future__ import annotations

import os
from collections.abc import Iterator

from encode.config import SourceConfig
from encode.sources.base import Partition, RawSample, Rejected, make_sample, parse_json
from encode.sources.listing import folder_key, sidecars_of
from shared import storage


def read_folder(partition: Partition, cfg: SourceConfig) -> Iterator[RawSample | Rejected]:
    """The bucket's images in key order, each with its `{stem}.txt` caption and optional `{stem}.json`."""
    sidecars = set(partition.sidecars)
    listed_sizes = {info.uri: info.size for info in partition.listed}
    seen: set[str] = set()
    for uri in partition.uris:
        key = folder_key(uri, partition.root)
        if key in seen:  # a.jpg and a.png: one key, keep the first
            yield Rejected(key, "duplicate_key")
            continue
        seen.add(key)
        caption_uri, json_uri = sidecars_of(uri, cfg)
        files = [u for u in (uri, caption_uri, json_uri) if u == uri or u in sidecars]
        if any(_leaves_root(u, partition.root) for u in files):
            yield Rejected(key, "link_outside_source")  # e.g. cat.txt -> ~/.aws/credentials
            continue
        if listed_sizes.get(uri, 0) > cfg.max_sample_bytes:
            yield Rejected(key, "file_too_large")
            continue
        if sum(listed_sizes.get(u, 0) for u in files) > cfg.max_sample_bytes:  # listed: nothing read yet
            yield Rejected(key, "sample_too_large")
            continue
        image = _read_optional(uri)
        caption = _read_optional(caption_uri) if caption_uri in sidecars else None
        meta = parse_json(_read_optional(json_uri)) if json_uri in sidecars else {}
        if image is None:  # deleted since listing
            yield Rejected(key, "missing_image")
            continue
        yield make_sample(key, image, caption, meta)


def _leaves_root(uri: str, root: str) -> bool:
    """A local file that resolves (through symlinks) outside the source folder: never read."""
    if storage.is_s3(uri):
        return False  # object keys are no links
    base = os.path.realpath(root or ".")
    return os.path.commonpath([base, os.path.realpath(uri)]) != base


def _read_optional(uri: str) -> bytes | None:
    try:
        return storage.read_bytes(uri)
    except FileNotFoundError:
        return None
