"""Train's default folders in the shared temp dir are per user and private; planted ones are refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from shared import storage
from tests.train.conftest import tiny_config
from train.data.loader import cache_dir_for, default_cache_root
from train.loop.prepare import local_run_dir


@pytest.fixture
def shared_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(storage.tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


def test_default_streaming_cache_is_private(shared_tmp: Path) -> None:
    root = Path(default_cache_root())
    assert root == shared_tmp / f"sd-pretrain-streaming-{os.getuid()}"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert cache_dir_for("", "/data/x", "v1", 64).startswith(str(root) + os.sep)


def test_planted_streaming_cache_is_refused_naming_the_key(shared_tmp: Path) -> None:
    (shared_tmp / "attacker").mkdir()
    (shared_tmp / f"sd-pretrain-streaming-{os.getuid()}").symlink_to(shared_tmp / "attacker")
    with pytest.raises(storage.StorageError, match=r"symlink.*data\.cache_dir"):
        cache_dir_for("", "/data/x", "v1", 64)


def test_run_dir_of_an_s3_run_is_private(shared_tmp: Path) -> None:
    cfg = tiny_config("/data/x", "s3://bucket/runs/a", shared_tmp / "cache")
    run_dir = Path(local_run_dir(cfg, "run-a"))
    assert run_dir.parent == shared_tmp / f"sd-pretrain-runs-{os.getuid()}"
    assert stat.S_IMODE(run_dir.parent.stat().st_mode) == 0o700


def test_planted_run_dir_is_refused_naming_the_key(shared_tmp: Path) -> None:
    planted = shared_tmp / f"sd-pretrain-runs-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o775)
    cfg = tiny_config("/data/x", "s3://bucket/runs/a", shared_tmp / "cache")
    with pytest.raises(storage.StorageError, match=r"writable.*log\.local_dir"):
        local_run_dir(cfg, "run-a")
