"""Find, fetch and read the Composer checkpoints this job writes (local folders or s3://).

Composer keeps `latest-rank0.pt` next to the checkpoints: a real symlink locally, and for an s3:// save
folder a text object `latest-rank0.pt.symlink` holding the key of the newest uploaded checkpoint. We follow
those ourselves (instead of Composer's `autoresume`, which for s3:// folders downloads into a local folder
literally named `s3:`) and hand Composer a plain `load_path`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from shared import storage

LATEST_NAME = "latest-rank0.pt"
SYMLINK_SUFFIX = ".symlink"
CHECKPOINT_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"
CHECKPOINT_SUFFIX = ".pt"


class CheckpointError(FileNotFoundError):
    """No usable checkpoint where one was expected; the message says where we looked."""


def find_latest_checkpoint(save_folder: str) -> str | None:
    """The newest complete checkpoint in a save folder, or None when the folder has none yet."""
    if storage.is_s3(save_folder):
        pointer = storage.join(save_folder, LATEST_NAME + SYMLINK_SUFFIX)
        if not storage.exists(pointer):
            return None
        bucket, _ = storage.split_s3(save_folder)
        key = storage.read_bytes(pointer).decode().strip()
        return f"{storage.S3_SCHEME}{bucket}/{key}"
    link = os.path.join(save_folder, LATEST_NAME)
    return os.path.realpath(link) if os.path.exists(link) else None


def resolve_checkpoint(path: str) -> str:
    """A checkpoint file as given, or a save folder's latest checkpoint."""
    if path.endswith(CHECKPOINT_SUFFIX) and storage.exists(path) and not os.path.isdir(path):
        return os.path.realpath(path) if not storage.is_s3(path) else path
    latest = find_latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(
            f"{path} is neither a checkpoint file nor a save folder holding {LATEST_NAME}; pass a .pt file "
            "written by `python -m train fit` or the save_folder of such a run"
        )
    return latest


def fetch_checkpoint(path: str, scratch: str | None = None) -> Path:
    """A local copy of a checkpoint (file or save folder; s3:// is downloaded into `scratch`)."""
    uri = resolve_checkpoint(path)
    if not storage.is_s3(uri):
        return Path(uri)
    dest = Path(scratch or tempfile.mkdtemp(prefix="sd-ckpt-")) / uri.rsplit("/", 1)[-1]
    bucket, key = storage.split_s3(uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    storage.s3_client().download_file(bucket, key, str(dest))
    return dest


def _checkpoint_safe_globals() -> list[Any]:
    """The non-tensor types a Composer 0.32 checkpoint pickles (timestamps, version, numpy RNG state)."""
    import datetime

    import numpy as np
    import torch

    dtypes = [type(np.dtype(t)) for t in (np.uint32, np.int32, np.int64, np.float32, np.float64, np.bool_)]
    return [
        datetime.timedelta,
        torch.torch_version.TorchVersion,
        np._core.multiarray._reconstruct,
        np.ndarray,
        np.dtype,
        *dtypes,
    ]


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a Composer checkpoint with `weights_only=True` (no arbitrary unpickling) plus the few plain types
    Composer stores. The trainer itself loads checkpoints through Composer (full unpickling), which is only
    ever pointed at our own save folders or the phase-1 checkpoint named by load_path."""
    import torch

    with torch.serialization.safe_globals(_checkpoint_safe_globals()):
        return torch.load(str(path), map_location="cpu", weights_only=True)
