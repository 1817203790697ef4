"""Stream one resolution of an encode output, pinned to one dataset version, into Composer.

Streaming gotchas that shape this module:
- a stale `index.json` in the local cache is trusted silently, and encode may publish a new version while
  we train. So we read the manifest, pick the version, and copy THAT version's index
  (`versions/<vid>/<res>/index.json`) into a cache folder keyed by (dataset root, version, resolution)
  before Streaming starts; shards are immutable and shared between versions, so any version's index names
  them correctly below `<root>/<res>/`.
- Streaming shares cache folders and shared memory between processes on a host without guarding either;
  `train/data/streaming_host.py` makes both safe (a folder lock per cache folder, a host lock over
  construction).

Stored files are data, not trusted: every index is checked against the manifest (columns, shapes, sample
counts, shard names that stay inside the folder) before Streaming sees it, local shard files against their
index entries, and shards written with hashes are verified when first read.

Every random draw of a training sample derives from (seed, epoch, sample index, copy of an upsampled sample:
train/data/copies.py) — see train/data/draws.py `sample_seed` — so a resumed run sees exactly the draws an
uninterrupted one has.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from shared import storage
from shared.contract import SHARD_HASH, TRAIN_COLUMNS, ContractError, IndexSummary, Shapes, check_index
from shared.manifest import DatasetManifest, Layout, fingerprint, read_manifest
from shared.runtime.children import rank_loader_worker, worker_handover_problem
from train.config import DataConfig
from train.data import copies, packing
from train.data.draws import SAMPLE_SEED, sample_seed
from train.data.packing import STREAM_INDEX
from train.data.shm import also_release, attached_without_exit_hold
from train.data.streaming_host import DataError, cache_limit_refusal, claim_local_dir, streaming_prefix_lock

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ version pin
@dataclass(frozen=True)
class PinnedData:
    """One resolution of one dataset version, with its index placed in a private local cache folder."""

    root: str
    version: str
    resolution: int
    manifest: DatasetManifest
    remote: str  # Layout.stream_root(resolution)
    local: str  # cache folder holding this version's index.json (and downloaded shards)
    hashed: bool = False  # every shard records SHARD_HASH: verify each when first read
    # A bucketed resolution (encode transform.buckets): "HxW" -> the cache folder holding that bucket's
    # index, for each bucket with samples; read as one Streaming stream per bucket (train/data/buckets.py).
    buckets: dict[str, str] = field(default_factory=dict)
    bucket: str = ""  # eval only (train/eval/data.py): `local` holds this one bucket's index

    @property
    def num_samples(self) -> int:
        if self.bucket:
            info = self.manifest.resolutions[self.resolution]
            return int((info.buckets or {})[self.bucket]["num_samples"])
        return self.manifest.num_samples(self.resolution)

    def record(self) -> dict[str, Any]:
        """What a checkpoint remembers about the data it was trained on (a bucketed resolution: also each
        bucket's samples, which export writes into the pipeline folder's buckets.json)."""
        out = {
            "uri": self.root,
            "version": self.version,
            "resolution": self.resolution,
            "fingerprint": self.manifest.dataset_fingerprint,
            "num_samples": self.num_samples,
        }
        info = self.manifest.resolutions[self.resolution]
        if self.buckets and info.buckets:
            out["buckets"] = {name: info.buckets[name]["num_samples"] for name in self.buckets}
        return out


RUN_CACHE_PREFIX = "run-"  # a training run's own folder in the default cache root (cache_dir_for)


def default_cache_root() -> str:
    """`<tmp>/sd-pretrain-streaming-<uid>`, private to this user: a computable path in the shared temp dir
    must not let another user plant shards we would train on."""
    return str(storage.private_temp_dir("sd-pretrain-streaming", "data.cache_dir"))


def cache_dir_for(cache_root: str, root: str, version: str, resolution: int, run_key: str = "") -> str:
    """`<cache_root>/<hash(root)>/<vid>/<res>`: one folder per live dataset, never shared across versions.

    In the default cache root, a training run's own subfolder `run-<hash(run_key)>` (its save folder): two
    live StreamingDatasets may not share a folder, and the second run on a host's data (a sweep, another
    recipe) was refused until given a data.cache_dir of its own. A resume of the run finds its shards
    again; a data.cache_dir the user names is used as it is."""
    folder = os.path.join(
        cache_root or default_cache_root(), fingerprint(root.rstrip("/")), version, str(resolution)
    )
    run_folder = os.path.join(folder, RUN_CACHE_PREFIX + fingerprint(run_key))
    return run_folder if run_key and not cache_root else folder


def read_dataset_manifest(cfg: DataConfig) -> DatasetManifest:
    """The manifest of the version this run trains on (data.version, or the current one)."""
    if not cfg.uri:
        raise DataError("data.uri is empty: pass data.uri=<output.uri of a finished `make encode` run>")
    return read_manifest(cfg.uri.rstrip("/"), cfg.version)


def pin_version(cfg: DataConfig, manifest: DatasetManifest, run_key: str = "") -> PinnedData:
    """Place the manifest's version's index for data.resolution in this dataset's own cache folder
    (`run_key`: a training run's save folder, see cache_dir_for).

    Call after the contract check: the resolution must exist in the manifest.
    """
    root = cfg.uri.rstrip("/")
    vid = manifest.version
    layout = Layout(root)
    local = cache_dir_for(cfg.cache_dir, root, vid, cfg.resolution, run_key)
    claim_local_dir(local)
    remote = layout.stream_root(cfg.resolution)
    info = manifest.resolutions[cfg.resolution]
    buckets: dict[str, str] = {}
    if info.buckets is not None:
        hashed = True
        for name, shapes in info.bucket_shapes(cfg.resolution).items():
            if not info.buckets[name]["num_samples"]:
                continue
            buckets[name] = os.path.join(local, name)
            claim_local_dir(buckets[name])
            index = layout.bucket_index(vid, cfg.resolution, name)
            count = info.buckets[name]["num_samples"]
            hashed = place_index(index, buckets[name], shapes, count, remote).hashed and hashed
    else:
        index = layout.version_index(vid, cfg.resolution)
        hashed = place_index(index, local, info.shapes, info.num_samples, remote).hashed
    if not hashed:
        log.warning(
            "%s: not every shard records a %s hash (written before encode hashed shards); shard contents "
            "are not verified on read. Re-encode into a fresh output.uri to add them",
            remote, SHARD_HASH,
        )  # fmt: skip
    return PinnedData(root, vid, cfg.resolution, manifest, remote, local, hashed, buckets)


def place_index(index_uri: str, local: str, shapes: Shapes, num_samples: int, remote: str) -> IndexSummary:
    """Check a version's index against the manifest (and local shard files against it), then copy it into
    the cache folder, replacing whatever index was there."""
    try:
        data = storage.read_bytes(index_uri)
    except FileNotFoundError:
        raise DataError(
            f"{index_uri} is missing: the dataset version was deleted (e.g. by `make encode-gc`); pass "
            "data.version=<a kept version> or drop data.version to use the current one"
        ) from None
    try:
        index = json.loads(data)
    except ValueError as err:
        raise ContractError(f"{index_uri} is not valid JSON ({err}); re-run `make encode`") from None
    summary = check_index(index, shapes, num_samples, index_uri)
    if not storage.is_s3(remote):
        from train.data.mds_reader import check_shard_files

        check_shard_files(index, remote)
    storage.write_bytes(os.path.join(local, "index.json"), data)
    return summary


# --------------------------------------------------------------------------------------------- dataset
def _streaming_dataset_class() -> type:
    from streaming import StreamingDataset

    from train.data import mds_reader

    class LatentStreamingDataset(copies.DistinctCopies, StreamingDataset):
        """StreamingDataset whose rows carry only the precomputed columns plus a per-sample seed.

        Streaming picks the epoch inside `__iter__` on each worker; `_get_work` is where that value is
        handed over, so we note it there and mix it into each row's seed. A shard that fails its hash
        check fails in Streaming's download thread, which the reading thread reports only as "Background
        thread failed"; `prepare_shard` keeps the real error so `get_item` raises it.
        """

        def __init__(self, *, seed: int, download_patience_s: float | None = None, **kwargs: Any) -> None:
            try:
                super().__init__(**kwargs)
            except ValueError as err:
                raise cache_limit_refusal(kwargs.get("cache_limit"), err) from None
            mds_reader.decode_train_columns_only(self.shards)
            mds_reader.download_patiently(self.streams, download_patience_s)
            self.sample_seed_base = seed
            self.current_epoch = 0
            self.epoch_failure: BaseException | None = None  # what ended the epoch (mds_reader.epoch_thread)

        def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
            try:
                super().prepare_shard(shard_id, blocking)
            except Exception as err:
                mds_reader.release_failed_shard(self, shard_id)
                failure = mds_reader.shard_failure(err)
                if failure is None:
                    raise
                raise failure from None

        def _prepare_thread(self, it: Any) -> None:
            with mds_reader.epoch_thread(self, it):
                super()._prepare_thread(it)

        def _ready_thread(self, it: Any) -> None:
            with mds_reader.epoch_thread(self, it):
                super()._ready_thread(it)

        def on_exception(self, future: Any) -> None:
            # Streaming re-raises an epoch thread's error here, where concurrent.futures only logs it, and
            # ends the epoch quietly, short (a full cache disk: an epoch of 0 samples, no error): __iter__
            # raises it instead, once (epoch_failure).
            if future.exception() is not None:
                self._event.set()

        def __iter__(self) -> Iterator[dict[str, Any]]:
            try:
                yield from super().__iter__()
            except RuntimeError:  # Streaming's "Background thread failed. Check other traceback."
                if self.epoch_failure is None:
                    raise
                raise self.epoch_failure from None
            if self.epoch_failure is not None:
                raise self.epoch_failure

        def load_state_dict(self, obj: dict[str, Any]) -> None:
            super().load_state_dict(obj)
            also_release(self, self._resume_shm)  # the segment Streaming keeps the resume state in

        def _resume(self, world: Any, epoch: int) -> tuple[int, int]:
            with attached_without_exit_hold():  # its read of the resume state, at every epoch
                return super()._resume(world, epoch)

        def _get_work(self, epoch: int, sample_in_epoch: int) -> Any:
            self.current_epoch = epoch
            return super()._get_work(epoch, sample_in_epoch)

        def get_item(self, sample_id: int, retry: int = 7) -> dict[str, Any]:
            import torch

            try:
                row = super().get_item(sample_id, retry)
            except RuntimeError:
                if self.epoch_failure is not None:
                    raise self.epoch_failure from None
                raise
            # MDS hands out read-only views of the shard; copy so torch owns writable memory.
            # A dataset stores one of the two text columns (text.store): take whichever this one has.
            out = {name: torch.from_numpy(row[name].copy()) for name in TRAIN_COLUMNS if name in row}
            # Python ints are collated into one int64 tensor per batch. The step turns each seed into the
            # sample's draws on the device (train/data/draws.py).
            index, copy = self.copy_of(sample_id)  # which copy of an upsampled sample (train/data/copies.py)
            out[SAMPLE_SEED] = sample_seed(self.sample_seed_base, self.current_epoch, index, copy)
            # Per-stream sample counts (train/data/stream_counts.py) are taken on the host from this column.
            shard_id, _ = self.spanner[sample_id]
            out[STREAM_INDEX] = int(self.stream_per_shard[shard_id])
            return out

    return LatentStreamingDataset


def build_dataset(
    cfg: DataConfig,
    pinned: PinnedData,
    per_rank_batch: int,
    seed: int,
    streams: list[Any] | None = None,
    batching_method: str | None = None,
    download_patience_s: float | None = None,
) -> Any:
    """The StreamingDataset over the pinned version (remote shards, private local cache); rows carry their
    stored training columns, their sample seed and their stream. `streams`: Streaming `Stream`s of a
    data.streams mix (train/data/mix.py) or of a bucketed dataset's buckets (train/data/buckets.py), read
    instead of `pinned`, batched by `batching_method` (None: data.batching_method). `download_patience_s`:
    how long a shard download waits out an S3 outage (train/data/mds_reader.py PatientStream; None:
    Streaming's own three tries)."""
    with streaming_prefix_lock() as created:
        return created(
            _new_dataset(cfg, pinned, per_rank_batch, seed, streams, batching_method, download_patience_s)
        )


def _new_dataset(
    cfg: DataConfig,
    pinned: PinnedData,
    per_rank_batch: int,
    seed: int,
    streams: list[Any] | None,
    batching_method: str | None = None,
    download_patience_s: float | None = None,
) -> Any:
    cls = _streaming_dataset_class()
    where: dict[str, Any] = {"remote": pinned.remote, "local": pinned.local}
    if streams:
        where = {"streams": streams, "batching_method": batching_method or cfg.batching_method}
    return cls(
        seed=seed,
        download_patience_s=download_patience_s,
        **where,
        epoch_size=cfg.epoch_size,
        batch_size=per_rank_batch,
        shuffle=cfg.shuffle,
        shuffle_algo=cfg.shuffle_algo,
        shuffle_seed=seed if cfg.shuffle_seed is None else cfg.shuffle_seed,
        shuffle_block_size=cfg.shuffle_block_size,
        num_canonical_nodes=cfg.num_canonical_nodes,
        predownload=cfg.predownload,
        cache_limit=cfg.cache_limit,
        download_timeout=cfg.download_timeout,
        validate_hash=SHARD_HASH if pinned.hashed and not streams else None,
    )


def build_dataloader(
    cfg: DataConfig,
    pinned: PinnedData,
    per_rank_batch: int,
    seed: int,
    streams: list[Any] | None = None,
    batching_method: str | None = None,
    download_patience_s: float | None = None,
) -> Any:
    """A StreamingDataLoader (Composer checkpoints its dataset's position, so resumes are mid-epoch exact)
    whose batches are packed into one buffer each (train/data/packing.py; `packing.unpack` gives the
    columns). It counts the samples it hands out per stream (`stream_taken`). `download_patience_s`: as
    build_dataset's."""
    dataset = build_dataset(cfg, pinned, per_rank_batch, seed, streams, batching_method, download_patience_s)
    check_one_batch_per_epoch(len(dataset), per_rank_batch, cfg)
    extra: dict[str, Any] = {}
    if cfg.num_workers > 0:
        extra = {"prefetch_factor": cfg.prefetch_factor, "persistent_workers": True}
        if problem := worker_handover_problem("data.num_workers=0"):
            raise DataError(problem)
    return packing.packed_loader_class()(
        dataset,
        batch_size=per_rank_batch,
        num_workers=cfg.num_workers,
        drop_last=True,
        pin_memory=_cuda_available(),
        collate_fn=packing.collate_packed,
        worker_init_fn=rank_loader_worker,  # gone with the rank (kill -9 too); its stop signals are its own
        **extra,
    )


def check_one_batch_per_epoch(rank_samples: int, per_rank_batch: int, cfg: DataConfig) -> None:
    """Refuse data smaller than one batch: with drop_last every epoch would be empty and Composer would
    count epochs forever without taking a step."""
    if rank_samples < per_rank_batch:
        raise DataError(
            f"the {cfg.resolution} px data at {cfg.uri or 'data.streams'} gives each rank {rank_samples} "
            f"samples, fewer than one per-rank batch of {per_rank_batch}, so no step could ever run; lower "
            "global_batch_size (and device_microbatch_size) or encode more data"
        )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
