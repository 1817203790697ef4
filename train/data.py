"""Stream one resolution of an encode output, pinned to one dataset version, into Composer.

Two Streaming gotchas shape this module:
- a stale `index.json` in the local cache is trusted silently, and encode may publish a new version while
  we train. So we read the manifest, pick the version, and copy THAT version's index
  (`versions/<vid>/<res>/index.json`) into a cache folder keyed by (dataset root, version, resolution)
  before Streaming starts; shards are immutable and shared between versions, so any version's index names
  them correctly below `<root>/<res>/`.
- two live StreamingDatasets may not share a local folder, and a process killed with SIGKILL leaves its
  shared-memory registration of that folder behind, which makes the restarted run fail with "Reused local
  directory". We hold an flock on the folder for the life of the process (the kernel drops it when the
  process dies), and whoever gets the lock removes registrations of *that* folder only.

Every random draw of a training sample is derived from (seed, epoch, sample index) — see `sample_seed` — so
a run resumed mid-epoch sees exactly the draws the uninterrupted run would have.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared import storage
from shared.contract import LATENT_LOGVAR, LATENT_MEAN, TEXT_EMBEDDING
from shared.manifest import DatasetManifest, Layout, fingerprint, read_manifest
from train.config import DataConfig

log = logging.getLogger(__name__)

SAMPLE_SEED = "sample_seed"  # int64 batch column: the seed of every random draw for that sample
TRAIN_COLUMNS = (LATENT_MEAN, LATENT_LOGVAR, TEXT_EMBEDDING)  # key and caption are never decoded into batches
_SEED_MASK = (1 << 63) - 1  # torch.Generator and int64 tensors both take a non-negative 63-bit seed
_LOCK_NAME = ".sd-pretrain.lock"
_PREFIX_RACE_ATTEMPTS = 5
_held_locks: dict[str, int] = {}  # local dir -> open fd holding its flock (released when the process exits)


class DataError(ValueError):
    """The dataset cannot be streamed as configured; the message names the fix."""


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of every random draw for one sample in one epoch: independent of ranks, workers, resumes."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


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

    @property
    def num_samples(self) -> int:
        return self.manifest.num_samples(self.resolution)

    def record(self) -> dict[str, Any]:
        """What a checkpoint remembers about the data it was trained on."""
        return {
            "uri": self.root,
            "version": self.version,
            "resolution": self.resolution,
            "fingerprint": self.manifest.dataset_fingerprint,
            "num_samples": self.num_samples,
        }


def default_cache_root() -> str:
    return os.path.join(tempfile.gettempdir(), "sd-pretrain-streaming")


def cache_dir_for(cache_root: str, root: str, version: str, resolution: int) -> str:
    """`<cache_root>/<hash(root)>/<vid>/<res>`: one folder per live dataset, never shared across versions."""
    return os.path.join(
        cache_root or default_cache_root(), fingerprint(root.rstrip("/")), version, str(resolution)
    )


def read_dataset_manifest(cfg: DataConfig) -> DatasetManifest:
    """The manifest of the version this run trains on (data.version, or the current one)."""
    if not cfg.uri:
        raise DataError("data.uri is empty: pass data.uri=<output.uri of a finished `make encode` run>")
    return read_manifest(cfg.uri.rstrip("/"), cfg.version)


def pin_version(cfg: DataConfig, manifest: DatasetManifest) -> PinnedData:
    """Place the manifest's version's index for data.resolution in this dataset's own cache folder.

    Call after the contract check: the resolution must exist in the manifest.
    """
    root = cfg.uri.rstrip("/")
    vid = manifest.version
    layout = Layout(root)
    local = cache_dir_for(cfg.cache_dir, root, vid, cfg.resolution)
    claim_local_dir(local)
    place_index(layout.version_index(vid, cfg.resolution), local)
    return PinnedData(root, vid, cfg.resolution, manifest, layout.stream_root(cfg.resolution), local)


def place_index(index_uri: str, local: str) -> None:
    """Copy a version's index into the cache folder, replacing whatever index was there."""
    try:
        data = storage.read_bytes(index_uri)
    except FileNotFoundError:
        raise DataError(
            f"{index_uri} is missing: the dataset version was deleted (e.g. by `make encode-gc`); pass "
            "data.version=<a kept version> or drop data.version to use the current one"
        ) from None
    storage.write_bytes(os.path.join(local, "index.json"), data)


# ------------------------------------------------------------------------------- local dir ownership
def claim_local_dir(local: str) -> None:
    """Lock `local` for this process and clear stale Streaming registrations of it left by a killed run.

    Only the node's local leader claims (ranks on a node share the folder by design). Raises when another
    live process holds the folder.
    """
    if int(os.environ.get("LOCAL_RANK", "0")) != 0 or local in _held_locks:
        return
    Path(local).mkdir(parents=True, exist_ok=True)
    fd = os.open(os.path.join(local, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataError(
            f"another process is streaming through {local}: two live StreamingDatasets may not share a "
            "cache folder; give this run its own data.cache_dir"
        ) from None
    _held_locks[local] = fd
    removed = remove_stale_registrations(local)
    if removed:
        log.warning("removed %d stale Streaming shared-memory registration(s) of %s", removed, local)


def remove_stale_registrations(local: str) -> int:
    """Unlink Streaming shared memory that registered `local` (only called while we hold its lock)."""
    # Streaming 0.13 internals: prefixes are scanned from 0 until a free one, LOCALS lists each prefix's
    # local folders. Any prefix that names our folder belongs to a dead process, since we hold the lock.
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, LOCALS, SHM_TO_CLEAN
    from streaming.base.shared.prefix import _get_path, _unpack_locals

    removed = 0
    target = os.path.abspath(local)
    for prefix_int in range(1 << 16):
        locals_shm = _attach_shm(_get_path(prefix_int, LOCALS))
        locks = [
            os.path.join(tempfile.gettempdir(), _get_path(prefix_int, n))
            for n in (BARRIER_FILELOCK, CACHE_FILELOCK)
        ]
        if locals_shm is None:
            if any(os.path.exists(p) for p in locks):
                continue
            break
        their_locals, _ = _unpack_locals(bytes(locals_shm.buf))
        locals_shm.close()
        if target not in (os.path.abspath(p) for p in their_locals):
            continue
        for name in SHM_TO_CLEAN:
            removed += _unlink_shm(_get_path(prefix_int, name))
        for path in locks:
            Path(path).unlink(missing_ok=True)
    return removed


def _attach_shm(name: str) -> Any:
    from multiprocessing import shared_memory

    try:
        return shared_memory.SharedMemory(name=name, create=False)
    except (FileNotFoundError, PermissionError):
        return None


def _unlink_shm(name: str) -> int:
    shm = _attach_shm(name)
    if shm is None:
        return 0
    shm.close()
    shm.unlink()
    return 1


# --------------------------------------------------------------------------------------------- dataset
def _streaming_dataset_class() -> type:
    from streaming import StreamingDataset

    class LatentStreamingDataset(StreamingDataset):
        """StreamingDataset whose rows carry only the precomputed columns plus a per-sample seed.

        Streaming picks the epoch inside `__iter__` on each worker; `_get_work` is where that value is
        handed over, so we note it there and mix it into each row's seed.
        """

        def __init__(self, *, seed: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.sample_seed_base = seed
            self.current_epoch = 0

        def _get_work(self, epoch: int, sample_in_epoch: int) -> Any:
            self.current_epoch = epoch
            return super()._get_work(epoch, sample_in_epoch)

        def get_item(self, sample_id: int, retry: int = 7) -> dict[str, Any]:
            import torch

            row = super().get_item(sample_id, retry)
            # MDS hands out read-only views of the shard; copy so torch owns writable memory.
            out = {name: torch.from_numpy(row[name].copy()) for name in TRAIN_COLUMNS}
            seed = sample_seed(self.sample_seed_base, self.current_epoch, int(sample_id))
            out[SAMPLE_SEED] = torch.tensor(seed, dtype=torch.int64)
            return out

    return LatentStreamingDataset


def build_dataset(cfg: DataConfig, pinned: PinnedData, per_rank_batch: int, seed: int) -> Any:
    """The StreamingDataset over the pinned version (remote shards, private local cache).

    Streaming picks its shared-memory prefix by "find the first free one, then create it", which races
    with any other process on the machine starting a StreamingDataset at the same moment (FileExistsError).
    Nothing is allocated before that point, so a single-process run simply tries again; under
    torch.distributed the ranks meet in barriers inside that code, so there we let the error surface.
    """
    import torch.distributed as torch_dist

    attempts = 1 if torch_dist.is_available() and torch_dist.is_initialized() else _PREFIX_RACE_ATTEMPTS
    for attempt in range(1, attempts):
        try:
            return _new_dataset(cfg, pinned, per_rank_batch, seed)
        except FileExistsError as err:
            log.warning("Streaming shared-memory prefix race (%s); retrying (%d/%d)", err, attempt, attempts)
            time.sleep(random.uniform(0.05, 0.5))
    return _new_dataset(cfg, pinned, per_rank_batch, seed)


def _new_dataset(cfg: DataConfig, pinned: PinnedData, per_rank_batch: int, seed: int) -> Any:
    cls = _streaming_dataset_class()
    return cls(
        seed=seed,
        remote=pinned.remote,
        local=pinned.local,
        batch_size=per_rank_batch,
        shuffle=cfg.shuffle,
        shuffle_algo=cfg.shuffle_algo,
        shuffle_seed=seed if cfg.shuffle_seed is None else cfg.shuffle_seed,
        shuffle_block_size=cfg.shuffle_block_size,
        num_canonical_nodes=cfg.num_canonical_nodes,
        predownload=cfg.predownload,
        cache_limit=cfg.cache_limit,
        download_timeout=cfg.download_timeout,
    )


def build_dataloader(cfg: DataConfig, pinned: PinnedData, per_rank_batch: int, seed: int) -> Any:
    """A StreamingDataLoader (Composer checkpoints its dataset's position, so resumes are mid-epoch exact)."""
    from streaming import StreamingDataLoader

    dataset = build_dataset(cfg, pinned, per_rank_batch, seed)
    check_one_batch_per_epoch(len(dataset), per_rank_batch, cfg)
    extra: dict[str, Any] = {}
    if cfg.num_workers > 0:
        extra = {"prefetch_factor": cfg.prefetch_factor, "persistent_workers": True}
    return StreamingDataLoader(
        dataset,
        batch_size=per_rank_batch,
        num_workers=cfg.num_workers,
        drop_last=True,
        pin_memory=_cuda_available(),
        **extra,
    )


def check_one_batch_per_epoch(rank_samples: int, per_rank_batch: int, cfg: DataConfig) -> None:
    """Refuse data smaller than one batch: with drop_last every epoch would be empty and Composer would
    count epochs forever without taking a step."""
    if rank_samples < per_rank_batch:
        raise DataError(
            f"the {cfg.resolution} px data at {cfg.uri} gives each rank {rank_samples} samples, fewer than "
            f"one per-rank batch of {per_rank_batch}, so no step could ever run; lower global_batch_size "
            f"(and device_microbatch_size) or encode more data"
        )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
