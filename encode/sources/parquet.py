"""img2dataset parquet output, one row group at a time."""

from __future__ import annotations

import contextlib
import posixpath
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from encode.config import SourceConfig
from encode.sources.base import RawSample, Rejected, SourceError, make_sample
from shared import storage

COPY_CHUNK_BYTES = 1 << 22


def read_parquet(uri: str, cfg: SourceConfig) -> Iterator[RawSample | Rejected]:
    """img2dataset parquet output, one row group at a time (a shard's images never sit in memory at once)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _seekable(uri) as handle:
        try:
            parquet = pq.ParquetFile(handle)
        except (pa.ArrowException, OSError):
            yield Rejected(None, "corrupt_parquet")
            return
        _check_columns(uri, parquet.schema_arrow, cfg)
        seen: set[str] = set()
        for index in range(parquet.num_row_groups):
            group = parquet.metadata.row_group(index)
            if group.total_byte_size > cfg.max_row_group_bytes:  # from metadata: nothing read yet
                yield Rejected(None, "row_group_too_large", count=max(group.num_rows, 1))
                continue
            try:
                table = parquet.read_row_group(index)
            except (pa.ArrowException, OSError):
                unread = sum(
                    parquet.metadata.row_group(i).num_rows for i in range(index, parquet.num_row_groups)
                )
                yield Rejected(None, "corrupt_parquet", count=max(unread, 1))
                return
            yield from _parquet_rows(table.to_pydict(), uri, index, seen, cfg)


def _rows_from(parquet: Any, first_group: int) -> int:
    """Rows in row groups `first_group`.. (what a corrupt row group takes down with it), at least 1."""
    groups = range(first_group, parquet.num_row_groups)
    return max(1, sum(parquet.metadata.row_group(i).num_rows for i in groups))


@contextlib.contextmanager
def _seekable(uri: str) -> Iterator[IO[bytes]]:
    """Parquet needs random access: local files open directly, S3 objects are spooled to a temp file."""
    if not storage.is_s3(uri):
        with open(uri, "rb") as handle:
            yield handle
        return
    with tempfile.TemporaryFile(prefix="sd-encode-parquet-") as spool:
        with contextlib.closing(storage.open_read(uri)) as stream:
            shutil.copyfileobj(stream, spool, COPY_CHUNK_BYTES)
        spool.seek(0)
        yield spool


def _check_columns(uri: str, schema: Any, cfg: SourceConfig) -> None:
    """The image and caption columns exist and hold bytes and text (a column of another type would fail
    every row of the file at its first use, far from the cause)."""
    import pyarrow as pa

    names = schema.names
    for column, setting in ((cfg.image_column, "image_column"), (cfg.caption_column, "caption_column")):
        if column not in names:
            raise SourceError(
                f"parquet file {uri} has no column {column!r} (columns: {', '.join(names)}); set "
                f"source.{setting}, or for img2dataset webdataset output (metadata-only .parquet next to "
                ".tar files) point source.uri at the .tar files"
            )
    image, caption = schema.field(cfg.image_column).type, schema.field(cfg.caption_column).type
    if not (_is_bytes(image) or (pa.types.is_struct(image) and _is_bytes(_struct_field(image, "bytes")))):
        raise SourceError(
            f"parquet file {uri}: column {cfg.image_column!r} is {image}, not encoded image files (binary, "
            "or a struct with a binary `bytes` field as Hugging Face datasets write); set "
            f"source.image_column to the column that holds them (columns: {', '.join(names)})"
        )
    if not (_is_bytes(caption) or pa.types.is_string(caption) or pa.types.is_large_string(caption)):
        raise SourceError(
            f"parquet file {uri}: column {cfg.caption_column!r} is {caption}, not text; set "
            f"source.caption_column to the column that holds the captions (columns: {', '.join(names)})"
        )


def _is_bytes(arrow_type: Any) -> bool:
    import pyarrow as pa

    return arrow_type is not None and (pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type))


def _struct_field(struct: Any, name: str) -> Any:
    index = struct.get_field_index(name)
    return struct.field(index).type if index >= 0 else None


def _parquet_rows(
    columns: dict[str, list[Any]], uri: str, group_index: int, seen: set[str], cfg: SourceConfig
) -> Iterator[RawSample | Rejected]:
    images = columns[cfg.image_column]
    captions = columns[cfg.caption_column]
    keys = columns.get(cfg.key_column)
    meta_names = [name for name in columns if name != cfg.image_column]
    stem = posixpath.splitext(uri.rsplit("/", 1)[-1])[0]
    for row, image in enumerate(images):
        if isinstance(image, dict):  # Hugging Face datasets' Image feature: {"bytes": ..., "path": ...}
            image = image.get("bytes")
        key = str(keys[row]) if keys is not None and keys[row] is not None else f"{stem}-{group_index}-{row}"
        if key in seen:
            yield Rejected(key, "duplicate_key")
            continue
        seen.add(key)
        if _row_bytes(image, captions[row]) > cfg.max_sample_bytes:
            yield Rejected(key, "sample_too_large")
            continue
        meta = {name: columns[name][row] for name in meta_names}
        yield make_sample(key, image, captions[row], meta)


def _row_bytes(image: Any, caption: Any) -> int:
    """Bytes of a row's image and caption (what a sample keeps in memory), for the per-sample budget."""
    return sum(len(value) for value in (image, caption) if isinstance(value, bytes | str))
