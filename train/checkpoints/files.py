"""Find, fetch and read the Composer checkpoints this job writes (local folders or s3://).

Composer keeps `latest-rank0.pt` next to the checkpoints: a real symlink locally, and for an s3:// save
folder a text object `latest-rank0.pt.symlink` holding the key of the newest uploaded checkpoint. We follow
those ourselves (instead of Composer's `autoresume`, which for s3:// folders downloads into a local folder
literally named `s3:`) and hand Composer a plain `load_path`.

Trust model: a checkpoint is data, never code. Every load (export, load_path, autoresume) goes through
torch's weights-only unpickler with an allow-list of the few plain types Composer stores (timedelta,
TorchVersion, numpy arrays and dtypes for the RNG state); anything else is refused naming the file. The
`latest` pointer must name a `.pt` file, or a sharded checkpoint folder (`train/checkpoints/sharded.py`:
FSDP runs on several ranks write one), directly inside its own save folder. A `latest` that cannot be
followed or loaded stops the job: resuming is never silently replaced by a fresh start that would
overwrite it. A local folder whose link is missing (killed while Composer re-pointed it) resumes from its
newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import posixpath
import re
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from composer.utils import checkpoint as composer_checkpoint

from shared import storage

log = logging.getLogger(__name__)

LATEST_NAME = "latest-rank0.pt"
# What Composer is told to name the pointer: per rank, as Composer's own default. Its CheckpointSaver removes
# the pointer on every rank but (sharded) recreates it on rank 0 only, with no barrier between: with one
# shared name a slower rank deleted the link rank 0 had just made (seen on 2 CPU ranks in 3 sharded runs of
# 4), and autoresume then found no checkpoint. Only rank 0 writes a pointer; it is LATEST_NAME.
LATEST_PATTERN = "latest-rank{rank}.pt"
SYMLINK_SUFFIX = ".symlink"
# Composer's CheckpointSaver writes an s3:// folder's `latest` pointer only once it has polled that the
# checkpoint's upload finished, every 30 s (a private attribute, which its own tests lower). So a stop
# waited up to 30 s after its upload (of the signal's lead time before the kill), every run's end as long,
# and a crash in that window resumed from the checkpoint before. The one rank that writes the pointer
# (global rank 0) then makes one HEAD request a second while an upload runs.
LATEST_POLL_S = 1.0
CHECKPOINT_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"
CHECKPOINT_SUFFIX = ".pt"
SCRATCH_PREFIX = "sd-ckpt-"
# A sharded checkpoint is a folder (Composer: `ep{epoch}-ba{batch}/`) holding torch.distributed.checkpoint's
# `.metadata` (written by rank 0, last) and one `__{rank}_0.distcp` per rank.
SHARDED_METADATA_NAME = ".metadata"
SHARDED_FOLDER = re.compile(r"^ep\d+-ba\d+$")  # CHECKPOINT_FILENAME's folder under Composer's sharded save
_RANK0_FILE = re.compile(r"^ep\d+-ba\d+-rank0\.pt$")
_BATCH = re.compile(r"-ba(\d+)")


class CheckpointError(FileNotFoundError):
    """No usable checkpoint where one was expected; the message says where we looked."""


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint (or the `latest` pointer to one) exists but cannot be loaded safely; the message names
    the file and the fix. Raised instead of starting fresh, so a broken `latest` is never overwritten."""


def poll_uploads_promptly(saver: Any) -> None:
    """Composer's CheckpointSaver polls for a finished upload every LATEST_POLL_S, not 30 s."""
    if saver is not None and hasattr(saver, "_symlink_upload_wait_before_next_try_in_seconds"):
        saver._symlink_upload_wait_before_next_try_in_seconds = LATEST_POLL_S


def is_sharded_checkpoint(path: str) -> bool:
    """A folder (local or s3://) holding a sharded checkpoint's `.metadata`."""
    if storage.is_s3(path):
        return storage.exists(storage.join(path, SHARDED_METADATA_NAME))
    return os.path.isfile(os.path.join(path, SHARDED_METADATA_NAME))


def checkpoint_location(save_folder: str, epoch: int, batch: int, sharded: bool) -> str:
    """Where the checkpoint of this step is for the user (a rerun resumes from it), the same on every rank:
    rank 0's file, or a sharded checkpoint's ep*-ba* folder, in save_folder. Not Composer's saved path: only
    the saving ranks have one, and for an s3:// save_folder it is the local copy staged for the upload."""
    name = f"ep{epoch}-ba{batch}" if sharded else CHECKPOINT_FILENAME.format(epoch=epoch, batch=batch, rank=0)
    return storage.join(save_folder, name) if storage.is_s3(save_folder) else os.path.join(save_folder, name)


def find_latest_checkpoint(save_folder: str) -> str | None:
    """The newest complete checkpoint in a save folder, or None when the folder has none yet: a `.pt`
    file, or a sharded checkpoint folder (see is_sharded_checkpoint).

    A pointer that exists but names something outside the save folder, something that is neither, or
    nothing at all raises UnsafeCheckpointError: that is a damaged or planted folder, not an empty one."""
    if storage.is_s3(save_folder):
        return _find_latest_s3(save_folder)
    link = os.path.join(save_folder, LATEST_NAME)
    if not os.path.lexists(link):
        return _newest_complete_local(save_folder)
    target = os.path.realpath(link)
    folder = os.path.realpath(save_folder)
    if os.path.dirname(target) != folder or not (target.endswith(CHECKPOINT_SUFFIX) or os.path.isdir(target)):
        raise UnsafeCheckpointError(
            f"{link} points to {target}, which is not a .pt checkpoint or sharded checkpoint folder directly "
            f"inside {folder}; remove or fix that link (or pass another save_folder) and rerun"
        )
    if not (os.path.isfile(target) or is_sharded_checkpoint(target)):
        raise UnsafeCheckpointError(
            f"{link} points to {target}, which does not exist or is an incomplete sharded checkpoint (no "
            f"{SHARDED_METADATA_NAME}); point the link at the newest complete checkpoint in that folder (or "
            "pass another save_folder to start fresh) and rerun"
        )
    return target


def _newest_complete_local(save_folder: str) -> str | None:
    """A local folder without its `latest` link: the newest complete checkpoint in it, or None.

    Composer re-points the link by removing it, then creating it: a process killed between the two (a
    second SIGTERM, the scheduler's kill after a stop's save) leaves the checkpoints without a link, and a
    fresh start would have overwritten them. Complete: a `.pt` whose zip directory (torch.save writes it
    last) is there, or a sharded folder with its `.metadata`; a save cut short is passed over."""
    found: list[tuple[int, str]] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(save_folder):
            match = _RANK0_FILE.match(entry.name) or SHARDED_FOLDER.match(entry.name)
            if match:
                found.append((int(_BATCH.search(entry.name).group(1)), entry.path))  # type: ignore[union-attr]
    for _, path in sorted(found, reverse=True):
        if is_sharded_checkpoint(path) if os.path.isdir(path) else zipfile.is_zipfile(path):
            log.warning(
                "%s is missing (a process was killed while Composer re-pointed it): resuming from the "
                "newest complete checkpoint, %s",
                os.path.join(save_folder, LATEST_NAME),
                path,
            )
            return os.path.realpath(path)
    return None


def _find_latest_s3(save_folder: str) -> str | None:
    pointer = storage.join(save_folder, LATEST_NAME + SYMLINK_SUFFIX)
    try:
        key = storage.read_bytes(pointer).decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    _, prefix = storage.split_s3(save_folder)
    name = posixpath.relpath(key, prefix.rstrip("/") or ".") if key else ""
    if not key or "/" in name or not (name.endswith(CHECKPOINT_SUFFIX) or SHARDED_FOLDER.match(name)):
        raise UnsafeCheckpointError(
            f"{pointer} names {key!r}, which is not a .pt checkpoint or sharded checkpoint folder directly "
            f"inside {save_folder}; fix or delete that object (or pass another save_folder) and rerun"
        )
    uri = storage.join(save_folder, name)
    complete = storage.exists(uri) if name.endswith(CHECKPOINT_SUFFIX) else is_sharded_checkpoint(uri)
    if not complete:
        raise UnsafeCheckpointError(
            f"{pointer} names {uri}, which does not exist or is an incomplete sharded checkpoint (no "
            f"{SHARDED_METADATA_NAME}); point it at the newest complete checkpoint in that folder (or delete "
            "it to start fresh) and rerun"
        )
    return uri


def resolve_checkpoint(path: str) -> str:
    """A checkpoint file or sharded checkpoint folder as given, or a save folder's latest checkpoint."""
    if path.endswith(CHECKPOINT_SUFFIX) and storage.exists(path) and not os.path.isdir(path):
        return os.path.realpath(path) if not storage.is_s3(path) else path
    if is_sharded_checkpoint(path):
        return os.path.realpath(path) if not storage.is_s3(path) else path.rstrip("/")
    latest = find_latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(
            f"{path} is neither a checkpoint (a .pt file or a sharded checkpoint folder) nor a save folder "
            f"holding {LATEST_NAME}; pass a checkpoint written by `python -m train fit` or the save_folder "
            "of such a run"
        )
    return latest


@contextlib.contextmanager
def fetched_checkpoint(path: str) -> Iterator[Path]:
    """A local copy of a checkpoint (file, sharded checkpoint folder or save folder) for the duration of
    the `with` block.

    A local checkpoint is used in place. An s3:// one (~14 GB for SD2-base) is downloaded into a private
    scratch folder that is removed when the block ends, also on error."""
    uri = resolve_checkpoint(path)
    if not storage.is_s3(uri):
        yield Path(uri)
        return
    scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
    try:
        dest = Path(scratch) / uri.rsplit("/", 1)[-1]
        if not uri.endswith(CHECKPOINT_SUFFIX):  # a sharded checkpoint folder (names checked on the way)
            yield storage.download_dir(uri, dest)
            return
        storage.download(uri, dest)
        yield dest
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _checkpoint_safe_globals() -> list[Any]:
    """The non-tensor types a Composer 0.32 checkpoint pickles (timestamps, version, numpy RNG state).
    Everything else a checkpoint holds (EMA, optimizer, callbacks) is tensors, dicts, lists, strings and
    numbers, which the weights-only unpickler accepts without an allow-list."""
    dtypes = [type(np.dtype(t)) for t in (np.uint32, np.int32, np.int64, np.float32, np.float64, np.bool_)]
    return [
        datetime.timedelta,
        torch.torch_version.TorchVersion,
        np._core.multiarray._reconstruct,
        np.ndarray,
        np.dtype,
        *dtypes,
    ]


def load_weights_only(path: str | Path, source: str | None = None, map_location: Any = "cpu") -> Any:
    """torch.load with `weights_only=True` (no arbitrary unpickling) plus the allow-list above.

    `source` names the checkpoint in errors when `path` is a downloaded copy (an s3:// URI). A file that
    would need any other type, or is not a torch checkpoint at all, raises UnsafeCheckpointError."""
    name = source or str(path)
    try:
        with torch.serialization.safe_globals(_checkpoint_safe_globals()):
            return torch.load(str(path), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if not zipfile.is_zipfile(path):  # torch's legacy reader on bytes that are no torch file at all
            raise UnsafeCheckpointError(
                f"cannot read {name} as a torch checkpoint: it is not a checkpoint (no torch zip archive). "
                f"Point load_path (or save_folder's {LATEST_NAME}) at one written by `python -m train fit`"
            ) from err
        raise UnsafeCheckpointError(
            f"refusing to load {name}: it holds objects other than tensors and plain data ({err}). Only "
            "checkpoints written by `python -m train fit` load; point load_path (or save_folder's "
            f"{LATEST_NAME}) at one of those"
        ) from err
    except (RuntimeError, EOFError, ValueError, KeyError, IndexError) as err:
        # KeyError / IndexError: torch's legacy (non-zip) reader on a short file that is no checkpoint
        raise UnsafeCheckpointError(
            f"cannot read {name} as a torch checkpoint ({type(err).__name__}: {err or 'no detail'}); it is "
            f"truncated or not a checkpoint. Point load_path (or save_folder's {LATEST_NAME}) at a complete "
            "checkpoint"
        ) from err


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a Composer checkpoint through the weights-only unpickler (see load_weights_only)."""
    return load_weights_only(path)


@contextlib.contextmanager
def composer_loads_weights_only(source: str | None) -> Iterator[None]:
    """While active, Composer's checkpoint loads go through load_weights_only instead of its own
    `torch.load(..., weights_only=False)`.

    Composer 0.32 routes every monolithic checkpoint load (load_path, autoresume, rank-0 monolith loads)
    through `composer.utils.checkpoint._torch_load_with_validation`; replacing that one function makes the
    very bytes Composer loads go through the safe unpickler (no second read, no check-then-load gap). The
    Trainer loads inside its constructor, so wrap `Trainer(...)` in this."""
    original = composer_checkpoint._torch_load_with_validation

    def safe_load(checkpoint_filepath: str | Path, map_location: str) -> Any:
        return load_weights_only(checkpoint_filepath, source or str(checkpoint_filepath), map_location)

    composer_checkpoint._torch_load_with_validation = safe_load
    try:
        yield
    finally:
        composer_checkpoint._torch_load_with_validation = original
