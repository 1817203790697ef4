"""Encode's staging and shard hashes: staging folders are private and per job, shards carry a hash that
train verifies on first read."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from streaming.base.hashing import get_hash

from encode.config import EncodeConfig
from encode.pipeline import RankInfo, run_rank
from encode.process.encoders import load_encoders
from encode.process.writer import remove_stale_staging, staging_prefix, staging_root
from encode.publish.finalize import publish
from encode.sample_data import build_webdataset
from shared import contract, storage
from shared.config import load_config
from shared.launch import control
from shared.manifest import Layout
from shared.storage.safety import NODE_TMPDIR_ENV

RES = 32


def small_encode_config(tmp_path: Path) -> EncodeConfig:
    """tmp_path/wds encoded to tmp_path/out at one small resolution, one worker."""
    overrides = [
        f"source.uri={tmp_path / 'wds'}", f"output.uri={tmp_path / 'out'}", "workers=1", "progress=false",
        f"filter.min_size={RES}", f"transform.resolutions=[{RES}]",
    ]  # fmt: skip
    return load_config(EncodeConfig, "sample", overrides, kind="datasets")


def test_s3_staging_is_private_to_the_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage.tempfile, "gettempdir", lambda: str(tmp_path))
    root = staging_root(Layout("s3://bucket/data"))
    assert root == tmp_path / f"sd-encode-staging-{os.getuid()}"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_a_planted_s3_staging_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage.tempfile, "gettempdir", lambda: str(tmp_path))
    planted = tmp_path / f"sd-encode-staging-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)  # anyone could drop a folder in it
    with pytest.raises(storage.StorageError, match=r"writable.*TMPDIR"):
        staging_root(Layout("s3://bucket/data"))


def test_stale_staging_removal_touches_only_this_jobs_partitions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage.tempfile, "gettempdir", lambda: str(tmp_path))
    mine, other_job = Layout("s3://bucket/mine"), Layout("s3://bucket/theirs")
    root = staging_root(mine)
    ours = root / f"{staging_prefix(mine, 'p00001')}deadbeef"
    kept = [
        root / f"{staging_prefix(other_job, 'p00001')}deadbeef",  # same partition id, another output
        root / f"{staging_prefix(mine, 'p00002')}deadbeef",  # our output, a partition we do not own
        root / "p00001-deadbeef",  # a name of the old scheme: nobody's we can prove
    ]
    for folder in [ours, *kept]:
        folder.mkdir()
    remove_stale_staging(mine, ["p00001"])
    assert not ours.exists()
    assert all(folder.exists() for folder in kept)


def test_a_live_encodes_staging_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two `encode run`s into one output at once: the second deleted the first's staged shards (it took them
    for a killed run's), and the first stopped halfway with "No such file or directory"."""
    import subprocess
    import time

    from encode.process import writer

    monkeypatch.setattr(storage.tempfile, "gettempdir", lambda: str(tmp_path))
    layout = Layout("s3://bucket/mine")
    root, prefix = staging_root(layout), staging_prefix(layout, "p00001")
    live = subprocess.Popen(["sleep", "30"])
    ended = subprocess.Popen(["true"])
    ended.wait()
    try:
        host = writer.staging_owner().split("-")[0]
        start = control.process_start(live.pid)
        live_folder = root / f"{prefix}{host}-{live.pid}-{start}.aaaa0000"
        dead_folder = root / f"{prefix}{host}-{ended.pid}-12345.bbbb0000"
        far_fresh = root / f"{prefix}000000-1-1.cccc0000"  # another host's (a shared output), fresh
        far_old = root / f"{prefix}000000-2-2.dddd0000"
        for folder in (live_folder, dead_folder, far_fresh, far_old):
            folder.mkdir()
        old = time.time() - writer.STALE_STAGING_S - 60
        os.utime(far_old, (old, old))
        remove_stale_staging(layout, ["p00001"])
        assert live_folder.exists() and far_fresh.exists()
        assert not dead_folder.exists() and not far_old.exists()
    finally:
        live.kill()
        live.wait()


def test_encoded_shards_record_a_hash_that_train_verifies(tmp_path: Path) -> None:
    from train.config import DataConfig
    from train.data.loader import pin_version, read_dataset_manifest

    build_webdataset(tmp_path / "wds", shards=1, per_shard=8, seed=5)
    cfg = small_encode_config(tmp_path)
    encoders = load_encoders(cfg)
    run_rank(cfg, RankInfo(0, 1), encoders)
    publish(cfg, encoders)
    layout = Layout(str(tmp_path / "out"))
    shards = json.loads(Path(layout.current_index(RES)).read_text())["shards"]
    assert shards
    for shard in shards:
        raw = shard["raw_data"]
        data = (Path(layout.stream_root(RES)) / raw["basename"]).read_bytes()
        assert raw["hashes"][contract.SHARD_HASH] == get_hash(contract.SHARD_HASH, data)
    data_cfg = DataConfig(uri=str(tmp_path / "out"), resolution=RES, cache_dir=str(tmp_path / "cache"))
    assert pin_version(data_cfg, read_dataset_manifest(data_cfg)).hashed


def test_rerun_removes_staging_left_by_a_kill_after_the_done_marker(tmp_path: Path) -> None:
    """A kill between a partition's done-marker and the removal of its staging folder leaves the folder of
    a partition that is already done: the rerun (with nothing left to encode) removes it too."""
    build_webdataset(tmp_path / "wds", shards=1, per_shard=4, seed=5)
    cfg = small_encode_config(tmp_path)
    encoders = load_encoders(cfg)
    run_rank(cfg, RankInfo(0, 1), encoders)
    layout = Layout(str(tmp_path / "out"))
    [marker] = Path(layout.parts_dir()).glob("*/*.json")
    left = staging_root(layout) / f"{staging_prefix(layout, marker.parent.name)}deadbeef"
    (left / str(RES)).mkdir(parents=True)
    run_rank(cfg, RankInfo(0, 1), encoders)
    assert not left.exists()


def test_a_staging_root_removed_under_a_new_writer_is_made_again_and_stays_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's cleanup removed the shared root between its creation and our mkdir: retried,
    and the S3 root comes back through private_temp_dir (mode 0700), not mkdir(parents=True)."""
    from encode.process import writer

    monkeypatch.setattr(storage.tempfile, "gettempdir", lambda: str(tmp_path))
    layout, calls = Layout("s3://bucket/mine"), []

    def removed_once(layout: Layout) -> Path:
        root = staging_root(layout)
        if not calls:
            root.rmdir()
        calls.append(root)
        return root

    monkeypatch.setattr(writer, "staging_root", removed_once)
    folder = writer.make_staging_folder(layout, "p00001.x")
    assert len(calls) == 2 and folder.is_dir()
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700


def test_the_staging_root_is_removed_only_when_empty(tmp_path: Path) -> None:
    from encode.process.writer import remove_staging_root_if_empty

    root = tmp_path / "_staging"
    (root / "another-writers-folder").mkdir(parents=True)
    remove_staging_root_if_empty(root)
    assert (root / "another-writers-folder").is_dir()
    (root / "another-writers-folder").rmdir()
    remove_staging_root_if_empty(root)
    assert not root.exists()
    remove_staging_root_if_empty(root)  # gone already: another process removed it first


STAGING_CHURN = """
import shutil, sys
from encode.process.writer import make_staging_folder, remove_staging_root_if_empty
from shared.manifest import Layout
layout = Layout(sys.argv[1])
for i in range(300):
    folder = make_staging_folder(layout, f"{sys.argv[2]}.{i}")
    (folder / "32").mkdir()
    shutil.rmtree(folder)
    remove_staging_root_if_empty(folder.parent)
"""


@pytest.mark.parametrize("where", ["local", "s3"])
def test_processes_sharing_a_staging_root_never_trip_over_its_cleanup(tmp_path: Path, where: str) -> None:
    """Two tasks of a Slurm array encoding into one local output: one checked the shared `_staging` root
    was empty, the other put its folder in it, and the first stopped on "Directory not empty" (CI); then
    one found the root there at its mkdir and gone at pathlib's is_dir() after it (CI again). S3 outputs
    share one private root in the temp folder (no S3 request is made here)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[3]
    output = str(tmp_path / "out") if where == "local" else "s3://bucket/out"
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {key: value for key, value in os.environ.items() if key != NODE_TMPDIR_ENV}
    churn = [
        subprocess.Popen(
            [sys.executable, "-c", STAGING_CHURN, output, f"task{task}"], cwd=repo,
            env={**env, "TMPDIR": str(temp)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for task in range(3)
    ]  # fmt: skip
    for process in churn:
        output_text, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output_text[-2000:]
    assert not (tmp_path / "out" / "_staging").exists() and not list(temp.iterdir())
