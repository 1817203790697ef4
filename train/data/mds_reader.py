"""An MDS shard reader that decodes only the columns training reads.

Streaming's MDSReader decodes every column of a row, including `key` and `caption`, which training never
uses: a caption with non-UTF-8 bytes in a stored shard would stop the job with a UnicodeDecodeError deep in
a dataloader worker. Columns outside TRAIN_COLUMNS are skipped, never decoded. And what a shard that cannot
be read or downloaded means for the user (`shard_failure`), shard downloads that wait out a short S3 outage
(`PatientStream`), Streaming's epoch threads handing their failure to the reading thread and ending their
epoch, or ending quietly on another's (`epoch_thread`), a failed shard left for whichever loader worker
reads it next (`release_failed_shard`), and the check of a local dataset's shard files before step 1
(`check_shard_files`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from streaming import Stream
from streaming.base.dataset import _ShardState
from streaming.base.format.mds.encodings import mds_decode
from streaming.base.format.mds.reader import MDSReader

from shared import storage
from shared.contract import SHARD_HASH, TRAIN_COLUMNS, ContractError
from shared.storage.errors import causes
from shared.storage.outage import wait_out_outages
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


class PatientStream(Stream):
    """A Streaming stream whose file downloads wait out an S3 outage for `download_patience_s` (each one
    after Streaming's own three tries; shared/storage/outage.py). The step that needs the shard waits
    meanwhile, and so do the other ranks, in their next collective: the patience stays under the
    collective timeout (train/config/sections.py ResilienceConfig.shard_patience_s), and a longer outage
    fails the ranks, which restart and wait for S3 before they read anything (train/resilience/outage.py)."""

    download_patience_s: float = 0.0

    def _download_file(self, from_basename: str, to_basename: str | None = None) -> str:
        parent = super()._download_file
        what = f"downloading {from_basename} of the dataset at {storage.redact_url(str(self.remote))}"
        setting = "3/4 of resilience.collective_timeout_s, hang_timeout_s on one rank"
        call = lambda: parent(from_basename, to_basename)  # noqa: E731
        return wait_out_outages(call, what, self.download_patience_s, setting=setting, sleep=_outage_pause)


class _EpochFailed(Exception):
    """Another of the epoch's threads failed while this one waited out an outage: nothing left to wait for."""


# .epoch_failed: the Event Streaming sets when one of the epoch's threads fails
_this_thread = threading.local()


def _outage_pause(seconds: float) -> None:
    """The pause between tries of a download waiting out an outage. In one of Streaming's epoch threads it
    ends early, with _EpochFailed, once the epoch has failed: the thread still waited out its own patience,
    up to a backoff (60 s) after the other thread's error ended the epoch, delaying the exit of a rank that
    was restarting, and then failed with a traceback of its own."""
    failed = getattr(_this_thread, "epoch_failed", None)
    if failed is None:
        time.sleep(seconds)
    elif failed.wait(seconds):
        raise _EpochFailed


def download_patiently(streams: list[Any], patience_s: float | None) -> None:
    """Make a dataset's streams wait out outages (None: Streaming's own tries only). A class swap, as
    `decode_train_columns_only` does: StreamingDataset builds the stream of a single dataset itself, and a
    module-level class pickles into the loader's worker processes."""
    if patience_s is None:
        return
    for stream in streams:
        if type(stream) is Stream:
            stream.__class__ = PatientStream
            stream.download_patience_s = patience_s


def shard_failure(err: Exception) -> Exception | None:
    """What a shard download that failed for good means for the user (None: not a data problem). Streaming
    raises it in its download thread, which the reading thread reports only as "Background thread
    failed" under a few hundred lines of traceback. An outage outlasting PatientStream's wait is itself
    (a transient StorageError: train/cli.py exits 1 and the supervisor restarts)."""
    if isinstance(err, storage.StorageError) and err.transient:
        return err
    if full := _disk_full(err):
        return DataError(
            f"the shard cache's disk is full ({full}): set data.cache_limit under that disk's free space "
            "(Streaming then evicts the coldest shards; docs/cluster.md says how to size it), or point "
            "data.cache_dir at a larger disk"
        )
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


def release_failed_shard(dataset: Any, shard_id: int) -> None:
    """After a shard of a Streaming `dataset` failed to download (or decompress): no copy of it stays in the
    cache, and no loader worker waits for it.

    Streaming checks a hash only when it downloads: the damaged copy it kept was taken as present by a later
    run, read unchecked (it trained on it and exited 0) or waited on forever. And it leaves the shard "being
    prepared" in the state its loader workers share, where another worker's ready thread waits for it to
    arrive, forever: the training process, waiting for that worker's batch, hung instead of raising the
    failure (the shipped recipes run 8 workers a rank). The shard is marked present without its files
    instead: Streaming prepares such a shard again when it is read (its path for a local folder holding only
    zips), so each worker that needs it meets the same failure itself, or none (an outage that has ended).
    The dataset's own files (read in place, never downloaded) are never touched."""
    stream = dataset.streams[dataset.stream_per_shard[shard_id]]
    if not stream.remote or os.path.abspath(stream.remote) == os.path.abspath(stream.local):
        return
    # Without Streaming's cache lock: a shard "being prepared" is this failed call's alone (no other worker
    # writes its state or files), and no cache bytes were counted for it. Taking the lock (a file) here, in
    # a worker ending after its run, made the lock file again after the run had removed it.
    if dataset._shard_states[shard_id] == _ShardState.PREPARING:
        dataset.shards[shard_id].evict()
        dataset._shard_states[shard_id] = _ShardState.LOCAL


def _disk_full(err: BaseException) -> BaseException | None:
    """The out-of-space error `err` is, or was raised from (boto3 writes a download itself)."""
    full = (errno.ENOSPC, errno.EDQUOT)
    return next((e for e in causes(err) if isinstance(e, OSError) and e.errno in full), None)


_MDS_OFFSET = np.dtype("<u4")  # an MDS shard starts with its sample count, then count + 1 uint32 offsets


def check_shard_files(index: dict[str, Any], stream_root: str) -> None:
    """Local datasets: each uncompressed shard file must be the size its index says and hold the samples it
    says (a truncated shard, or an index whose count disagrees with its shard, would crash mid-epoch).
    Reads only each shard's header. S3 shards are checked by their hash when first downloaded."""
    for shard in index["shards"]:
        raw = shard["raw_data"]
        path = storage.contained_path(stream_root, raw["basename"], f"shard {raw['basename']}")
        if not path.is_file():
            if shard.get("zip_data"):
                continue  # only the compressed file is stored; Streaming checks it when it decompresses
            raise ContractError(f"shard file {path} named by the index is missing; re-run `make encode`")
        problem = _shard_file_problem(path, int(raw["bytes"]), int(shard["samples"]))
        if problem:
            raise ContractError(
                f"shard file {path} {problem}; it was truncated or edited after `make encode`: re-run "
                "`make encode` into a fresh output.uri"
            )


def _shard_file_problem(path: Path, size: int, samples: int) -> str | None:
    actual = path.stat().st_size
    if actual != size:
        return f"is {actual} bytes but its index says {size}"
    with open(path, "rb") as handle:
        header = handle.read(_MDS_OFFSET.itemsize * (samples + 2))
    if len(header) < _MDS_OFFSET.itemsize * (samples + 2):
        return f"is too short for the {samples} samples its index says"
    count, *offsets = np.frombuffer(header, _MDS_OFFSET).tolist()
    if count != samples:
        return f"holds {count} samples but its index says {samples}"
    if offsets[-1] != actual:
        return f"ends its last sample at byte {offsets[-1]}, not at its size {actual}"
    return None


@contextlib.contextmanager
def epoch_thread(dataset: Any, it: Any) -> Iterator[None]:
    """Run one of the epoch threads (download, ready) of a Streaming `dataset` over `it`, its `_Iterator`.

    Streaming ends an epoch once two of its three loops (download, ready, yield) have counted themselves
    out (`it.on_exit()`), and a thread that raises never did: an outage that failed both threads (its ready
    thread downloads a shard itself when it gets there first) left the epoch's end waiting forever. And it
    only logged a thread's error, a traceback under "exception calling callback", then ended the epoch
    quietly, short: the error is kept (the first one) in `dataset.epoch_failure` for the reading thread to
    raise. A thread waiting out an outage when another's failure ends the epoch (Streaming sets
    `dataset._event`) ends as if its loop had seen that: quietly."""
    _this_thread.epoch_failed = dataset._event
    try:
        yield
    except _EpochFailed:
        it.on_exit()
    except BaseException as err:
        if dataset.epoch_failure is None:
            dataset.epoch_failure = err
        it.on_exit()
        raise
    finally:
        _this_thread.epoch_failed = None
