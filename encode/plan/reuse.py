"""Read columns of earlier partition outputs back, by key, so unchanged work is copied instead of recomputed.

Rows are read with Streaming's own MDS reader from a local copy of the partition folder (downloaded first
when the output lives in S3). Copied arrays are bit-identical to what was stored. Only a key -> row
location map is held in memory; arrays are read when a row is written (a 10k-sample SD2 partition holds
~2 GB of embeddings, too much to keep per worker).

A stored output is only a cache of work that can be redone from the source, and whoever can write the
output bucket can plant one: before any row is read, its index must declare exactly the contract's columns
and encodings (an undeclared `pkl` column would run code when a row is decoded) and plain shard file names.
A folder that fails the check is not reused: its rows are encoded again from the source, so nothing good
is lost and nothing planted is read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from encode.plan.fingerprints import ReuseSource
from encode.plan.integrity import UnsafeOutputError, check_shard_entry
from shared import contract, storage
from shared.manifest import INDEX_NAME

log = logging.getLogger("encode")


def open_mds_readers(folder: str | Path, scratch: str, shapes: contract.Shapes | None = None) -> list[Any]:
    """Streaming's shard readers for a local MDS folder (one partition output). A shard stored compressed
    only is decompressed into `scratch` (made when needed), never into `folder`: that may be a published
    version's, which a half-written file would break for the trainers reading it.

    Raises UnsafeOutputError, before reading a row, if the index is not what the contract declares.
    """
    from streaming.base.compression import decompress
    from streaming.base.format import reader_from_json

    folder = str(folder)
    index_uri = os.path.join(folder, INDEX_NAME)
    try:
        index = json.loads(Path(index_uri).read_text())
        entries = index["shards"]
    except (ValueError, KeyError, TypeError) as err:
        raise UnsafeOutputError(f"{index_uri} is not an MDS index ({err})") from err
    if not isinstance(entries, list):
        raise UnsafeOutputError(f"{index_uri} is not an MDS index (its shards are not a list)")
    for info in entries:
        check_shard_entry(info, index_uri, shapes)
    readers = []
    for info in entries:
        reader = reader_from_json(folder, None, info)
        if not os.path.exists(os.path.join(folder, reader.raw_data.basename)) and reader.zip_data is not None:
            zipped = Path(folder, reader.zip_data.basename).read_bytes()
            raw = Path(scratch, reader.raw_data.basename)
            raw.parent.mkdir(parents=True, exist_ok=True)
            raw.write_bytes(decompress(reader.compression, zipped))
            reader = reader_from_json(scratch, None, info)
        readers.append(reader)
    return readers


def iter_mds_rows(folder: str | Path) -> Iterator[dict[str, Any]]:
    """Every row of a local MDS folder, in write order."""
    with tempfile.TemporaryDirectory(prefix="mds-rows-") as scratch:
        for reader in open_mds_readers(folder, scratch):
            yield from reader


RowRef = tuple[Any, int]  # (shard reader, row index in that shard)


@dataclass
class ReuseTable:
    """key -> where reusable columns of that key are stored. Call `close()` when the partition is done."""

    text: dict[str, tuple[str, RowRef]] = field(default_factory=dict)  # key -> (raw caption, row)
    latents: dict[int, dict[str, RowRef]] = field(default_factory=dict)  # res -> key -> row
    _tmpdirs: list[str] = field(default_factory=list)

    def text_for(self, key: str, caption: str) -> np.ndarray | None:
        hit = self.text.get(key)
        # An embedding is only valid for the exact caption it was computed from (the source may have changed).
        if hit is None or hit[0] != caption:
            return None
        reader, idx = hit[1]
        return contract.stored_text(reader.get_item(idx))  # embeddings, or token ids (text.store=tokens)

    def has_latents(self, key: str, resolution: int) -> bool:
        return key in self.latents.get(resolution, {})

    def latents_for(self, key: str, resolution: int) -> tuple[np.ndarray, np.ndarray] | None:
        ref = self.latents.get(resolution, {}).get(key)
        if ref is None:
            return None
        row = ref[0].get_item(ref[1])
        return row[contract.LATENT_MEAN], row[contract.LATENT_LOGVAR]

    def close(self) -> None:
        for tmp in self._tmpdirs:
            shutil.rmtree(tmp, ignore_errors=True)
        self._tmpdirs.clear()


def load_reuse_table(
    sources: Sequence[ReuseSource], shapes_for: Callable[[int, Any], contract.Shapes] | None = None
) -> ReuseTable:
    """Index reusable rows of earlier outputs (first source wins per key: they come newest first).

    `shapes_for(resolution, bucket)`: the contract's shapes there, so a stored folder must match them exactly.
    A folder the contract does not allow is skipped with a warning: its rows are encoded again.
    """
    table = ReuseTable()
    try:
        fill_reuse_table(table, sources, shapes_for)
    except BaseException:  # an outage mid-copy, a Ctrl-C: the copies made so far go, not left in TMPDIR
        table.close()
        raise
    return table


def fill_reuse_table(
    table: ReuseTable,
    sources: Sequence[ReuseSource],
    shapes_for: Callable[[int, Any], contract.Shapes] | None,
) -> None:
    scratch = tempfile.mkdtemp(prefix="reuse-")  # decompressed shards, one folder a source
    table._tmpdirs.append(scratch)
    for number, source in enumerate(sources):
        folder = _local_copy(source.uri, table)
        if folder is None:
            continue  # gone (garbage-collected): its work is simply redone
        try:
            shapes = shapes_for(source.resolution, source.bucket) if shapes_for else None
            readers = open_mds_readers(folder, os.path.join(scratch, str(number)), shapes)
        except UnsafeOutputError as err:
            log.warning("not reusing %s, its rows are encoded again: %s", source.uri, err)
            continue
        for reader in readers:
            for idx in range(reader.samples):
                row = reader.get_item(idx)
                key = row[contract.KEY]
                if source.text and key not in table.text:
                    table.text[key] = (row[contract.CAPTION], (reader, idx))
                if source.latents:
                    table.latents.setdefault(source.resolution, {}).setdefault(key, (reader, idx))


def _local_copy(uri: str, table: ReuseTable) -> str | None:
    """The folder to read (an S3 one copied into a temp dir); None when its index is gone.

    An S3 folder is copied by name from its index, never from a listing: a listing that misses a key (a
    store without read-after-write listings, a reply that went astray) would silently turn reusable work
    into work done again."""
    if not storage.is_s3(uri):
        return uri if os.path.exists(os.path.join(uri, INDEX_NAME)) else None
    try:
        index_bytes = storage.read_bytes(storage.join(uri, INDEX_NAME))
    except FileNotFoundError:
        return None
    tmp = tempfile.mkdtemp(prefix="reuse-")
    table._tmpdirs.append(tmp)
    Path(tmp, INDEX_NAME).write_bytes(index_bytes)
    for name in _files_named_by(index_bytes):
        try:
            dest = storage.contained_path(tmp, name, f"shard {name} of {uri}")
        except storage.StorageError:
            break  # open_mds_readers refuses the index, naming the shard
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            storage.download(storage.join(uri, name), dest)
        except FileNotFoundError:
            continue  # only the raw or only the zipped copy is stored; a shard with neither is refused there
    return tmp


def _files_named_by(index_bytes: bytes) -> list[str]:
    """The raw and zipped shard file names an MDS index names (none if it is not one: refused later)."""
    try:
        shards = json.loads(index_bytes)["shards"]
        return [str(s[k]["basename"]) for s in shards for k in ("raw_data", "zip_data") if s.get(k)]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []
