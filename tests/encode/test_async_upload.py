"""Finished partitions upload on a background thread while the next one encodes (issue 11 item 8.2).

Against the SeaweedFS S3 server: the published shards are byte-identical to the synchronous path, the
first partition's upload really runs while the next partition is being encoded, and a failed upload fails
the job without a done-marker; a rerun then lands every sample exactly once.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from encode.config import EncodeConfig
from encode.pipeline import RankInfo, run_rank
from encode.plan.reuse import iter_mds_rows
from encode.process.encoders import Encoders, load_encoders
from encode.publish.finalize import publish
from encode.sample_data import build_webdataset
from shared import contract, storage
from shared.config import ConfigError, load_config
from shared.manifest import Layout, read_manifest

SHARDS, PER_SHARD = 3, 12
LOW, HIGH = 32, 64
OVERLAP_WAIT_S = 60.0  # how long the first upload waits to see the next partition encode


def make_cfg(source: str, output: str, *overrides: str) -> EncodeConfig:
    base = [
        f"source.uri={source}",
        f"output.uri={output}",
        "workers=1",
        "progress=false",
        "encoder.batch_size=4",
        f"filter.min_size={LOW}",
        f"transform.resolutions=[{LOW},{HIGH}]",
    ]
    return load_config(EncodeConfig, "sample", [*base, *overrides], kind="datasets")


@pytest.fixture(scope="module")
def encoders() -> Encoders:
    return load_encoders(make_cfg("unused", "unused"))


@pytest.fixture
def s3_source(tmp_path: Path, s3_prefix: str) -> str:
    local = tmp_path / "wds"
    build_webdataset(local, shards=SHARDS, per_shard=PER_SHARD, seed=5)
    uri = storage.join(s3_prefix, "in")
    storage.upload_dir(local, uri)
    shutil.rmtree(local, ignore_errors=True)
    return uri


def shard_bytes(output: str) -> dict[str, bytes]:
    """Every published shard file (relative path -> bytes), markers and manifests left out (they hold
    timestamps and the resolved config)."""
    files = {}
    for info in storage.list_files(output):
        rel = storage.relpath(info.uri, output)
        if rel.split("/")[0].isdigit() and rel.count("/") >= 2:  # <res>/<partition>-<fp>/<file>
            files[rel] = storage.read_bytes(info.uri)
    return files


def published_keys(output: str, resolution: int, scratch: Path) -> list[str]:
    """The key of every row of one resolution of the current version, read through its partitions."""
    keys = []
    for part in read_manifest(output).partitions:
        dirname = part["dirs"].get(str(resolution))
        if dirname:
            local = storage.download_dir(
                Layout(output).partition_output(resolution, dirname), scratch / dirname
            )
            keys += [row[contract.KEY] for row in iter_mds_rows(local)]
    return keys


def wrap_upload(monkeypatch: pytest.MonkeyPatch, before: Callable[[str], None]) -> list[str]:
    """Call `before(uri)` ahead of every partition upload; returns the names of the uploading threads."""
    real, threads = storage.upload_dir, []

    def upload_dir(local_dir: str | Path, uri: str) -> None:
        threads.append(threading.current_thread().name)
        before(uri)
        real(local_dir, uri)

    monkeypatch.setattr(storage, "upload_dir", upload_dir)
    return threads


def test_background_uploads_publish_the_same_bytes_as_synchronous(
    s3_source: str, s3_prefix: str, encoders: Encoders
) -> None:
    sync_out, async_out = storage.join(s3_prefix, "sync"), storage.join(s3_prefix, "async")
    sync = run_rank(make_cfg(s3_source, sync_out, "output.max_pending_uploads=0"), RankInfo(0, 1), encoders)
    both = run_rank(make_cfg(s3_source, async_out, "output.max_pending_uploads=2"), RankInfo(0, 1), encoders)
    assert (
        [m.partition for m in both.markers]
        == [m.partition for m in sync.markers]
        == [
            "00000-tar",
            "00001-tar",
            "00002-tar",
        ]
    )
    assert [m.outputs for m in both.markers] == [m.outputs for m in sync.markers]
    published = shard_bytes(async_out)
    assert published and published == shard_bytes(sync_out)


def test_upload_overlaps_encoding_the_next_partition(
    s3_source: str, s3_prefix: str, encoders: Encoders, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first upload waits until the VAE has encoded more images: only possible if the main thread
    is not the one stuck in the upload."""
    overlapped: list[bool] = []

    def wait_for_more_encoding(uri: str) -> None:
        if overlapped:
            return
        start, deadline = encoders.images_encoded, time.monotonic() + OVERLAP_WAIT_S
        while encoders.images_encoded == start and time.monotonic() < deadline:
            time.sleep(0.05)
        overlapped.append(encoders.images_encoded > start)

    threads = wrap_upload(monkeypatch, wait_for_more_encoding)
    summary = run_rank(make_cfg(s3_source, storage.join(s3_prefix, "out")), RankInfo(0, 1), encoders)
    assert len(summary.markers) == SHARDS and not summary.failed
    assert overlapped == [True], "the first partition's upload blocked the encoding of the next one"
    assert all(name.startswith("encode-publish") for name in threads)


@pytest.mark.parametrize("pending", [0, 1])
def test_failed_upload_fails_the_job_without_a_marker(
    s3_source: str,
    s3_prefix: str,
    encoders: Encoders,
    monkeypatch: pytest.MonkeyPatch,
    pending: int,
    tmp_path: Path,
) -> None:
    out = storage.join(s3_prefix, "out")
    cfg = make_cfg(s3_source, out, f"output.max_pending_uploads={pending}")

    def fail_second_partition(uri: str) -> None:
        if "/00001-tar-" in uri:
            raise storage.StorageError(f"injected upload failure for {uri}")

    wrap_upload(monkeypatch, fail_second_partition)
    with pytest.raises(storage.StorageError, match="injected upload failure"):
        run_rank(cfg, RankInfo(0, 1), encoders)
    markers = [
        storage.relpath(f.uri, Layout(out).parts_dir()) for f in storage.list_files(Layout(out).parts_dir())
    ]
    assert markers and not any(m.startswith("00001-tar/") for m in markers)

    monkeypatch.undo()  # the store works again: the rerun redoes only what has no marker
    again = run_rank(cfg, RankInfo(0, 1), encoders)
    assert "00001-tar" in [m.partition for m in again.markers]
    assert publish(cfg, encoders).manifest.samples_read == SHARDS * PER_SHARD
    reference = storage.join(s3_prefix, "ref")
    run_rank(make_cfg(s3_source, reference), RankInfo(0, 1), encoders)
    publish(make_cfg(s3_source, reference), encoders)
    for res in (LOW, HIGH):
        keys = published_keys(out, res, tmp_path / f"out-{res}")
        assert len(keys) == len(set(keys)), "a sample landed twice"
        assert sorted(keys) == sorted(published_keys(reference, res, tmp_path / f"ref-{res}"))


def test_negative_pending_uploads_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"output\.max_pending_uploads"):
        make_cfg("in", "out", "output.max_pending_uploads=-1")
