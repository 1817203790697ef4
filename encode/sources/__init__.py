"""Read what users have (img2dataset webdataset tars, img2dataset parquet, a folder of images with .txt
captions; local or s3://) in a deterministic order, and never crash on the data itself.

The unit of work and of resumability is a `Partition`: one input shard, or one hash bucket of a folder.
`read_partition` yields `RawSample`s and `Rejected` records; anything wrong with the *data* (a truncated tar,
a zero-byte image, a caption that is not UTF-8, a member named `../evil.jpg`) becomes a `Rejected` with a
short reason, never an exception. Problems the user must fix (a missing brace-range member, an empty glob,
a parquet file without the configured image column) raise with a message naming the fix. A storage error
while streaming (a dropped S3 connection) propagates too: it is not the data's fault, and recording it
as a reject would mark a partition done with samples silently missing.

Everything here is plain data and functions, so partitions and the reader pickle into worker processes.
"""

from __future__ import annotations

from collections.abc import Iterator

from encode.config import SourceConfig
from encode.sources.base import (
    FOLDER,
    MAX_MEMBER_BYTES,
    PARQUET,
    WEBDATASET,
    Partition,
    RawSample,
    Rejected,
    SourceError,
    count_by_reason,
)
from encode.sources.folder import read_folder
from encode.sources.listing import folder_bucket, folder_key, list_partitions, partition_id
from encode.sources.parquet import read_parquet
from encode.sources.webdataset import read_webdataset

__all__ = [
    "FOLDER",
    "MAX_MEMBER_BYTES",
    "PARQUET",
    "WEBDATASET",
    "Partition",
    "RawSample",
    "Rejected",
    "SourceError",
    "count_by_reason",
    "folder_bucket",
    "folder_key",
    "list_partitions",
    "partition_id",
    "read_folder",
    "read_parquet",
    "read_partition",
    "read_webdataset",
]


def read_partition(partition: Partition, cfg: SourceConfig) -> Iterator[RawSample | Rejected]:
    """Every sample of a partition in a deterministic order, with each unusable one as a `Rejected`."""
    if partition.kind == WEBDATASET:
        for uri in partition.uris:
            yield from read_webdataset(uri, cfg)
    elif partition.kind == PARQUET:
        for uri in partition.uris:
            yield from read_parquet(uri, cfg)
    elif partition.kind == FOLDER:
        yield from read_folder(partition, cfg)
    else:
        raise SourceError(f"unknown partition kind {partition.kind!r} (expected webdataset, parquet, folder)")
