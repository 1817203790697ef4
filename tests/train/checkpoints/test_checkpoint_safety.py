"""A checkpoint is data, never code: hostile .pt files and `latest` pointers are refused, nothing runs,
the job stops naming the file, and `latest` is left as it was (issue 14.1).

The hostile checkpoint is a real torch zip whose pickle holds an object that, if unpickled with Composer's
default `weights_only=False`, calls `open(marker, "w")`: the marker file appearing means code ran.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from shared import storage
from tests.train.conftest import run_train_cli, tiny_config, tiny_overrides
from train.checkpoints.files import (
    LATEST_NAME,
    SYMLINK_SUFFIX,
    UnsafeCheckpointError,
    checkpoint_location,
    find_latest_checkpoint,
)
from train.loop.trainer import fit

CLI_TIMEOUT_S = 300
# Past the batch the planted checkpoints are named after (ba99, ba4): a run that had reached max_duration
# is told so from the name alone (train/loop/prepare.py check_not_finished) before anything is loaded.
PAST_THE_NAMED_BATCH = "max_duration=200ba"


class CreatesMarker:
    """Unpickling this creates `path` (what a real attack would replace with a shell command)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


def write_hostile_checkpoint(path: Path, marker: Path) -> bytes:
    """A Composer-shaped checkpoint with the payload inside its state; returns its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": {"timestamp": CreatesMarker(marker), "model": {}}, "rng": []}, path)
    return path.read_bytes()


def test_hostile_load_path_is_refused_without_running_code(tiny_dataset: str, tmp_path: Path) -> None:
    marker, evil = tmp_path / "pwned", tmp_path / "phase1" / "ep9-ba99-rank0.pt"
    write_hostile_checkpoint(evil, marker)
    cfg = tiny_config(
        tiny_dataset, tmp_path / "save", tmp_path / "cache", f"load_path={evil}", "max_duration=2ba"
    )
    with pytest.raises(UnsafeCheckpointError, match=re.escape(str(evil))):
        fit(cfg)
    assert not marker.exists()
    assert not list((tmp_path / "save").glob("*.pt"))  # nothing trained, nothing saved


def test_hostile_local_latest_stops_the_cli_and_stays_latest(tiny_dataset: str, tmp_path: Path) -> None:
    marker, save = tmp_path / "pwned", tmp_path / "save"
    evil = save / "ep9-ba99-rank0.pt"
    before = write_hostile_checkpoint(evil, marker)
    os.symlink(evil.name, save / LATEST_NAME)
    args = ["fit", "tiny", *tiny_overrides(tiny_dataset, save, tmp_path / "cache", PAST_THE_NAMED_BATCH)]
    proc = run_train_cli(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode != 0, out
    # A user error: one line naming the file and why, no traceback.
    assert f"error: refusing to load {evil}" in out and "Traceback" not in out
    assert not marker.exists()
    assert os.readlink(save / LATEST_NAME) == evil.name and evil.read_bytes() == before
    assert sorted(p.name for p in save.glob("*.pt")) == [evil.name, LATEST_NAME]


@pytest.mark.s3
def test_hostile_s3_latest_is_refused_and_left_alone(
    tiny_dataset: str, s3_prefix: str, tmp_path: Path
) -> None:
    marker, save = tmp_path / "pwned", f"{s3_prefix}/run"
    local = tmp_path / "evil.pt"
    write_hostile_checkpoint(local, marker)
    _, prefix = storage.split_s3(save)
    storage.write_bytes(f"{save}/ep9-ba99-rank0.pt", local.read_bytes())
    pointer = f"{save}/{LATEST_NAME}{SYMLINK_SUFFIX}"
    storage.write_bytes(pointer, f"{prefix}/ep9-ba99-rank0.pt".encode())
    cfg = tiny_config(
        tiny_dataset, save, tmp_path / "cache", PAST_THE_NAMED_BATCH, f"log.local_dir={tmp_path / 'local'}"
    )
    with pytest.raises(UnsafeCheckpointError, match=re.escape(f"{save}/ep9-ba99-rank0.pt")):
        fit(cfg)
    assert not marker.exists()
    # Composer's CheckpointSaver had made its staging folder for the s3:// run (tmpXXXX/<key path>): the
    # failed start took it away, not left one per attempt in the temp folder
    temp = Path(tempfile.gettempdir())
    assert not [entry for entry in temp.iterdir() if (entry / prefix).is_dir()]
    assert storage.read_bytes(pointer) == f"{prefix}/ep9-ba99-rank0.pt".encode()
    names = sorted(storage.relpath(f.uri, save) for f in storage.list_files(save))
    assert names == ["ep9-ba99-rank0.pt", LATEST_NAME + SYMLINK_SUFFIX]


@pytest.mark.s3
@pytest.mark.parametrize(
    "target",
    ["{other}/ep1-ba4-rank0.pt", "{prefix}/../elsewhere/ep1-ba4-rank0.pt", "{prefix}/sub/ep1-ba4-rank0.pt",
     "{prefix}/notes.txt", ""],
    ids=["other-prefix", "dot-dot", "subfolder", "not-a-checkpoint", "empty"],
)  # fmt: skip
def test_s3_latest_pointer_must_stay_inside_the_save_folder(s3_prefix: str, target: str) -> None:
    save = f"{s3_prefix}/run"
    _, prefix = storage.split_s3(save)
    other = storage.split_s3(f"{s3_prefix}/other")[1]
    key = target.format(prefix=prefix, other=other)
    if key and ".." not in key:  # the object exists (S3 refuses `..` keys); the pointer is still refused
        storage.write_bytes(f"s3://{storage.split_s3(save)[0]}/{key}", b"not loaded")
    storage.write_bytes(f"{save}/{LATEST_NAME}{SYMLINK_SUFFIX}", key.encode())
    with pytest.raises(UnsafeCheckpointError, match="inside"):
        find_latest_checkpoint(save)


@pytest.mark.s3
def test_s3_latest_naming_a_missing_checkpoint_is_an_error_not_a_fresh_start(s3_prefix: str) -> None:
    save = f"{s3_prefix}/run"
    _, prefix = storage.split_s3(save)
    storage.write_bytes(f"{save}/{LATEST_NAME}{SYMLINK_SUFFIX}", f"{prefix}/ep1-ba4-rank0.pt".encode())
    with pytest.raises(UnsafeCheckpointError, match="does not exist"):
        find_latest_checkpoint(save)


def test_local_latest_must_stay_inside_the_save_folder(tmp_path: Path) -> None:
    save, outside = tmp_path / "save", tmp_path / "elsewhere" / "ep1-ba4-rank0.pt"
    save.mkdir()
    outside.parent.mkdir()
    outside.write_bytes(b"x")
    os.symlink(outside, save / LATEST_NAME)
    with pytest.raises(UnsafeCheckpointError, match="inside"):
        find_latest_checkpoint(str(save))


def test_dangling_local_latest_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    (tmp_path / "save").mkdir()
    os.symlink("ep1-ba4-rank0.pt", tmp_path / "save" / LATEST_NAME)
    with pytest.raises(UnsafeCheckpointError, match="does not exist"):
        find_latest_checkpoint(str(tmp_path / "save"))


def test_a_missing_local_latest_resumes_from_the_newest_complete_checkpoint(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Composer re-points `latest` by removing it, then linking: a kill between the two left a folder of
    checkpoints without a link, and the rerun started fresh over them (save_overwrite)."""
    from train.loop.prepare import resolve_start

    save = tmp_path / "save"
    save.mkdir()
    for batch in (4, 8):
        torch.save({"state": {}}, save / f"ep0-ba{batch}-rank0.pt")
    (save / "ep0-ba12-rank0.pt").write_bytes(b"PK\x03\x04 cut short by a kill mid-save")
    (save / "ep0-ba10").mkdir()  # a sharded save whose .metadata was never written
    (save / "ep0-ba10" / "__0_0.distcp").write_bytes(b"x")
    assert find_latest_checkpoint(str(save)) == str(save / "ep0-ba8-rank0.pt")
    start = resolve_start(tiny_config(tiny_dataset, save, tmp_path / "cache", PAST_THE_NAMED_BATCH))
    assert start.resuming and start.load_path == str(save / "ep0-ba8-rank0.pt")
    for name in ("ep0-ba4-rank0.pt", "ep0-ba8-rank0.pt"):
        (save / name).unlink()
    assert find_latest_checkpoint(str(save)) is None  # nothing complete: a fresh start loses nothing


def test_a_truncated_checkpoint_is_refused_naming_it(tiny_dataset: str, tmp_path: Path) -> None:
    save = tmp_path / "save"
    save.mkdir()
    (save / "ep1-ba4-rank0.pt").write_bytes(b"PK\x03\x04 truncated")
    os.symlink("ep1-ba4-rank0.pt", save / LATEST_NAME)
    cfg = tiny_config(tiny_dataset, save, tmp_path / "cache", PAST_THE_NAMED_BATCH)
    with pytest.raises(UnsafeCheckpointError, match=re.escape("ep1-ba4-rank0.pt")):
        fit(cfg)
    assert os.readlink(save / LATEST_NAME) == "ep1-ba4-rank0.pt"


@pytest.mark.parametrize(
    ("folder", "sharded", "expected"),
    [
        ("s3://bkt/runs/a", False, "s3://bkt/runs/a/ep1-ba12-rank0.pt"),
        ("s3://bkt/runs/a/", True, "s3://bkt/runs/a/ep1-ba12"),
        ("/data/runs/a", False, "/data/runs/a/ep1-ba12-rank0.pt"),
    ],
)
def test_a_stop_names_the_checkpoint_where_it_lives(folder: str, sharded: bool, expected: str) -> None:
    """What a resumable stop and the supervisor's "a rerun resumes from" print, on every rank (Composer's
    saved path exists on the saving ranks only, and is the staged local copy for an s3:// save_folder)."""
    assert checkpoint_location(folder, 1, 12, sharded) == expected
