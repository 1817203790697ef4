"""An MDS shard reader that decodes only the columns training reads.

Streaming's MDSReader decodes every column of a row, including `key` and `caption`, which training never
uses: a caption with non-UTF-8 bytes in a stored shard would stop the job with a UnicodeDecodeError deep in
a dataloader worker. Columns outside TRAIN_COLUMNS are skipped, never decoded. And what a shard that cannot
be read or downloaded means for the user (`shard_failure`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from streaming.base.format.mds.encodings import mds_decode
from streaming.base.format.mds.reader import MDSReader

from shared import storage
from shared.contract import SHARD_HASH, TRAIN_COLUMNS
from train.data.streaming_host import DataError

_SIZE_PREFIX = np.dtype("<u4")  # a variable-size MDS value is preceded by its byte count


class TrainColumnsReader(MDSReader):
    """MDSReader whose rows hold only TRAIN_COLUMNS (the same byte layout, fewer columns decoded)."""

    def decode_sample(self, data: bytes) -> dict[str, Any]:
        sizes, idx = [], 0
        for size in self.column_sizes:
            if size is None:
                size = int(np.frombuffer(data[idx : idx + _SIZE_PREFIX.itemsize], _SIZE_PREFIX)[0])
                idx += _SIZE_PREFIX.itemsize
            sizes.append(size)
        sample = {}
        for name, encoding, size in zip(self.column_names, self.column_encodings, sizes, strict=True):
            if name in TRAIN_COLUMNS:
                sample[name] = mds_decode(encoding, data[idx : idx + size])
            idx += size
        return sample


def decode_train_columns_only(shards: list[Any]) -> None:
    """Make each plain MDSReader of a dataset skip the columns training never reads."""
    for shard in shards:
        if type(shard) is MDSReader:
            shard.__class__ = TrainColumnsReader


def shard_failure(err: Exception) -> DataError | None:
    """What a shard download that failed for good means for the user (None: not a data problem). Streaming
    raises it in its download thread, which the reading thread reports only as "Background thread
    failed" under a few hundred lines of traceback."""
    text = str(err)
    if isinstance(err, ValueError) and "Checksum failure" in text:
        return DataError(
            f"{err}: the shard's bytes do not match the {SHARD_HASH} hash its index recorded at encode "
            "time, so it was changed or damaged after encoding; re-run `make encode` into a fresh output.uri "
            "(or restore the file)"
        )
    # Streaming's S3 download names a missing object "Object <uri> not found!"; a local one is a
    # FileNotFoundError.
    if isinstance(err, FileNotFoundError) or " not found! " in text:
        what = storage.redact_url(text.split(" Either ")[0])
        return DataError(
            f"a shard this dataset version's index names is missing ({what}): "
            "it was deleted after encoding (`encode gc --force`, a bucket lifecycle rule, by hand); restore "
            "it, or re-run `make encode` into a fresh output.uri, or pass data.version=<another version>"
        )
    return None
