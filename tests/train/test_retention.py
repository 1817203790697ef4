"""Remote checkpoint retention: the newest N checkpoints stay, older ones go, `latest` is never deleted.

The s3:// path runs end to end in test_s3.py; here the same code runs on a local folder (storage helpers
treat both alike), with the odd cases spelled out.
"""

from __future__ import annotations

import os
from pathlib import Path

from train.callbacks import RemoteCheckpointRetention


def make_folder(root: Path, batches: list[int], latest: int) -> None:
    root.mkdir()
    for batch in batches:
        (root / f"ep{batch // 4}-ba{batch}-rank0.pt").write_bytes(b"x")
    (root / "metrics.jsonl").write_text("{}\n")
    os.symlink(f"ep{latest // 4}-ba{latest}-rank0.pt", root / "latest-rank0.pt")


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_keeps_the_newest_and_deletes_the_rest(tmp_path: Path) -> None:
    make_folder(tmp_path / "run", [2, 4, 6, 8, 10], latest=10)
    deleted = RemoteCheckpointRetention(str(tmp_path / "run"), keep=2).prune()
    assert len(deleted) == 3
    assert names(tmp_path / "run") == [
        "ep2-ba10-rank0.pt",
        "ep2-ba8-rank0.pt",
        "latest-rank0.pt",
        "metrics.jsonl",
    ]


def test_never_deletes_what_latest_points_to(tmp_path: Path) -> None:
    # E.g. a run restarted from an older checkpoint with save_overwrite: latest is not the highest batch.
    make_folder(tmp_path / "run", [2, 4, 6], latest=2)
    RemoteCheckpointRetention(str(tmp_path / "run"), keep=1).prune()
    assert names(tmp_path / "run") == [
        "ep0-ba2-rank0.pt",
        "ep1-ba6-rank0.pt",
        "latest-rank0.pt",
        "metrics.jsonl",
    ]


def test_fewer_than_keep_deletes_nothing(tmp_path: Path) -> None:
    make_folder(tmp_path / "run", [2], latest=2)
    assert RemoteCheckpointRetention(str(tmp_path / "run"), keep=3).prune() == []
