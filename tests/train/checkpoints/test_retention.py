"""Checkpoint retention (one class for local, shared-filesystem and s3:// save folders): the newest N
checkpoints stay, older ones go, `latest` and anything newer than it (unconfirmed uploads) are never
deleted, earlier jobs' checkpoints are pruned too, and pruning runs once per checkpoint, off the training
thread (issues 10.2 and 11.1).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from composer.core import Callback, State
from composer.loggers import Logger

from shared import storage
from tests.train.conftest import tiny_config
from train.checkpoints.files import LATEST_POLL_S, find_latest_checkpoint
from train.checkpoints.retention import CheckpointRetention

UPLOAD_TIMEOUT_S = 120


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
        ([2, 4, 6], 4, 1, ["ep1-ba4-rank0.pt", "ep1-ba6-rank0.pt"]),
        # s3: ba8 and ba10 are uploaded but Composer has not confirmed them and moved latest yet.
        ([2, 4, 6, 8, 10], 6, 1, ["ep1-ba6-rank0.pt", "ep2-ba10-rank0.pt", "ep2-ba8-rank0.pt"]),
    ],
    ids=["keeps-the-newest", "never-deletes-latest", "never-deletes-unconfirmed-uploads"],
)
def test_prune_keeps_the_newest_and_what_latest_points_to(
    tmp_path: Path, batches: list[int], latest: int, keep: int, left: list[str]
) -> None:
    make_folder(tmp_path / "run", batches, latest)
    deleted = CheckpointRetention(str(tmp_path / "run"), keep, "1ba").prune()
    assert len(deleted) == len(batches) - len(left)
    assert names(tmp_path / "run") == [*left, "latest-rank0.pt", "metrics.jsonl"]


def test_fewer_than_keep_deletes_nothing(tmp_path: Path) -> None:
    make_folder(tmp_path / "run", [2], latest=2)
    assert CheckpointRetention(str(tmp_path / "run"), 3, "1ba").prune() == []


def test_no_latest_deletes_nothing(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    for batch in (2, 4, 6):
        (tmp_path / "run" / f"ep0-ba{batch}-rank0.pt").write_bytes(b"x")
    assert CheckpointRetention(str(tmp_path / "run"), 1, "1ba").prune() == []


def test_a_sharded_folder_a_crash_left_half_written_goes_and_is_not_counted(tmp_path: Path) -> None:
    """ba4 lost its save (no `.metadata`: the job died mid-save and resumed from ba2, saving on another
    schedule). Counted as one of the 2 kept, it left a single loadable checkpoint."""
    run = tmp_path / "run"
    for batch, complete in ((2, True), (4, False), (6, True), (8, False)):
        (run / f"ep0-ba{batch}").mkdir(parents=True)
        (run / f"ep0-ba{batch}" / "__0_0.distcp").write_bytes(b"x")
        if complete:
            (run / f"ep0-ba{batch}" / ".metadata").write_bytes(b"m")
    os.symlink("ep0-ba6", run / "latest-rank0.pt")
    deleted = CheckpointRetention(str(run), 2, "1ba").prune()
    assert deleted == [str(run / "ep0-ba4")]
    # ba8 is after latest: an upload not confirmed yet, never touched
    assert names(run) == ["ep0-ba2", "ep0-ba6", "ep0-ba8", "latest-rank0.pt"]


def test_local_retention_prunes_earlier_jobs_checkpoints(tiny_dataset: str, tmp_path: Path) -> None:
    """Cancel + resubmit: Composer alone prunes only what its own process saved (6 files were left)."""
    from train.loop.trainer import fit

    save = tmp_path / "save"
    common = ("save_interval=1ba", "save_num_checkpoints_to_keep=3", "samples.enabled=false")
    fit(tiny_config(tiny_dataset, save, tmp_path / "cache", "max_duration=4ba", *common))
    assert [name for name in names(save) if name.startswith("ep")] == [
        "ep0-ba2-rank0.pt",
        "ep0-ba3-rank0.pt",
        "ep0-ba4-rank0.pt",
    ]
    fit(tiny_config(tiny_dataset, save, tmp_path / "cache", "max_duration=8ba", *common))
    checkpoints = [name for name in names(save) if name.startswith("ep")]
    assert checkpoints == ["ep0-ba6-rank0.pt", "ep0-ba7-rank0.pt", "ep0-ba8-rank0.pt"]
    assert os.readlink(save / "latest-rank0.pt") == "ep0-ba8-rank0.pt"


class RequestsPerStep(Callback):
    """S3 requests made through shared.storage during each step's window (batch_end to batch_end)."""

    def __init__(self) -> None:
        self.last = 0
        self.by_step: dict[int, int] = {}

    def batch_end(self, state: State, logger: Logger) -> None:
        total = sum(storage.request_counts().values())
        self.by_step[int(state.timestamp.batch)] = total - self.last
        self.last = total


@pytest.mark.s3
@pytest.mark.slow  # Composer's S3 uploader starts worker processes that each import Composer
def test_s3_keep_1_ends_with_only_the_newest_and_makes_no_requests_between_checkpoints(
    tiny_dataset: str, s3_prefix: str, tmp_path: Path
) -> None:
    from train.loop.trainer import build_trainer, close_trainer

    save = f"{s3_prefix}/run"
    cfg = tiny_config(
        tiny_dataset, save, tmp_path / "cache", "max_duration=12ba", "save_interval=4ba",
        "save_num_remote_checkpoints_to_keep=1", "samples.enabled=false",
        f"log.local_dir={tmp_path / 'local'}",
    )  # fmt: skip
    trainer = build_trainer(cfg)
    counter = RequestsPerStep()
    trainer.state.callbacks.append(counter)
    saver = trainer._checkpoint_saver
    # The job polls for finished uploads every second (train/checkpoints/files.py LATEST_POLL_S); a stall (a
    # checkpoint deleted before Composer saw it) fails the test in 2 minutes instead of hanging an hour.
    assert saver._symlink_upload_wait_before_next_try_in_seconds == LATEST_POLL_S
    saver.upload_timeout_in_seconds = UPLOAD_TIMEOUT_S
    try:
        trainer.fit()
    finally:
        close_trainer(trainer)  # as fit() closes: also the local staging of the s3:// run's checkpoints

    checkpoints = [f.uri for f in storage.list_files(save) if f.uri.endswith(".pt")]
    assert checkpoints == [find_latest_checkpoint(save)]
    assert checkpoints[0].endswith("-ba12-rank0.pt")
    # Checkpoints at 4 and 8 (their mirror sync and pruning land in the next one or two step windows, the
    # one at 12 after the last step); step 1 includes start-up. The steps that save read the save folder's
    # claim first (one GET: train/checkpoints/owner.py confirm). Every other step: no S3 request at all.
    quiet = {step: counter.by_step[step] for step in (2, 3, 4, 7, 8, 11, 12)}
    assert quiet == {step: int(step % 4 == 0) for step in quiet}
