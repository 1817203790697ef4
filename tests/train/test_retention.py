"""Remote checkpoint retention: the newest N checkpoints stay, older ones go, `latest` is never deleted.

The s3:// path runs end to end in test_s3.py; here the same code runs on a local folder (storage helpers
treat both alike), with the odd cases spelled out.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from train.callbacks import RemoteCheckpointRetention


def make_folder(root: Path, batches: list[int], latest: int) -> None:
    root.mkdir()
    for batch in batches:
        (root / f"ep{batch // 4}-ba{batch}-rank0.pt").write_bytes(b"x")
    (root / "metrics.jsonl").write_text("{}\n")
    os.symlink(f"ep{latest // 4}-ba{latest}-rank0.pt", root / "latest-rank0.pt")


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize(
    ("batches", "latest", "keep", "left"),
    [
        ([2, 4, 6, 8, 10], 10, 2, ["ep2-ba10-rank0.pt", "ep2-ba8-rank0.pt"]),
        # A run restarted from an older checkpoint with save_overwrite: latest is not the highest batch.
        ([2, 4, 6], 2, 1, ["ep0-ba2-rank0.pt", "ep1-ba6-rank0.pt"]),
    ],
    ids=["keeps-the-newest", "never-deletes-latest"],
)
def test_prune_keeps_the_newest_and_what_latest_points_to(
    tmp_path: Path, batches: list[int], latest: int, keep: int, left: list[str]
) -> None:
    make_folder(tmp_path / "run", batches, latest)
    deleted = RemoteCheckpointRetention(str(tmp_path / "run"), keep).prune()
    assert len(deleted) == len(batches) - len(left)
    assert names(tmp_path / "run") == [*left, "latest-rank0.pt", "metrics.jsonl"]


def test_fewer_than_keep_deletes_nothing(tmp_path: Path) -> None:
    make_folder(tmp_path / "run", [2], latest=2)
    assert RemoteCheckpointRetention(str(tmp_path / "run"), keep=3).prune() == []
