"""Checkpoint uploads to an s3:// save folder (train/checkpoints/uploads.py), through Composer's own
RemoteUploader with its spawned worker processes and the loopback S3 server: the workers upload what
Composer's function did (the refusal of an existing object included) without importing torch or Composer,
which each of them did before (~700 MB and ~13 s of CPU a worker on a 2-core box)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from composer.utils.remote_uploader import RemoteUploader

from shared import storage
from shared.storage import transfers
from shared.storage.s3_server import S3Server
from tests.s3_outage import outage_proxy
from train.checkpoints.uploads import (
    PatientUploads,
    SmallChecks,
    is_plain_s3,
    upload_patiently_from,
    upload_to_s3,
)

# What a worker process has imported, asked of the worker itself: `eval` pickles by name, so the probe
# brings no module of its own into the worker.
HEAVY_MODULES = "sorted({m.split('.')[0] for m in __import__('sys').modules} & {'torch', 'composer'})"
WAIT_S = 120


@pytest.fixture
def uploader(s3_prefix: str) -> Iterator[RemoteUploader]:
    """Composer's uploader for `s3_prefix` with one worker (the probe meets the process that uploaded), made
    patient as the training job makes it."""
    made = RemoteUploader(remote_folder=s3_prefix, num_concurrent_uploads=1)
    upload_patiently_from(SimpleNamespace(remote_uploader=made), patience_s=30)
    yield made
    made.wait_and_close()
    made._tempdir.cleanup()  # Composer's staging folder, else removed only when the uploader is collected


def test_a_checkpoint_upload_runs_in_a_worker_that_imports_no_torch(
    uploader: RemoteUploader, s3_prefix: str, tmp_path: Path
) -> None:
    local = tmp_path / "ep0-ba4-rank0.pt"
    local.write_bytes(os.urandom(3 * 1024 * 1024 + 5))
    name = f"{storage.split_s3(s3_prefix)[1]}/{local.name}"
    uploader.upload_file_async(remote_file_name=name, file_path=local, overwrite=False).result(WAIT_S)
    assert storage.read_bytes(f"{s3_prefix}/{local.name}") == local.read_bytes()
    assert os.listdir(uploader._upload_staging_folder) == []  # the staged copy is removed, as Composer does
    worker = uploader.upload_executor
    assert isinstance(worker, PatientUploads)
    assert worker.executor.submit(eval, HEAVY_MODULES).result(WAIT_S) == []


def test_an_existing_checkpoint_is_refused_unless_overwrite(
    uploader: RemoteUploader, s3_prefix: str, tmp_path: Path
) -> None:
    local = tmp_path / "latest-rank0.pt.symlink"
    name = f"{storage.split_s3(s3_prefix)[1]}/{local.name}"
    local.write_bytes(b"first")
    uploader.upload_file_async(remote_file_name=name, file_path=local, overwrite=False).result(WAIT_S)
    local.write_bytes(b"second")
    refused = uploader.upload_file_async(remote_file_name=name, file_path=local, overwrite=False)
    assert isinstance(refused.exception(WAIT_S), FileExistsError)
    uploader.futures.clear()  # the refusal was expected: not one for wait_and_close to raise
    uploader.upload_file_async(remote_file_name=name, file_path=local, overwrite=True).result(WAIT_S)
    assert storage.read_bytes(f"{s3_prefix}/{local.name}") == b"second"


def test_the_poll_for_uploaded_files_answers_composer_in_a_worker_that_imports_no_torch(
    uploader: RemoteUploader, s3_prefix: str, tmp_path: Path
) -> None:
    """The poll `latest` waits on: EXIST once every file is there (Composer's own enum member reaches the
    rank), TIMEOUT when one never comes, ERROR once an upload failed."""
    from composer.utils.remote_uploader import RemoteFilesExistingCheckStatus as Status

    key = storage.split_s3(s3_prefix)[1]
    storage.write_bytes(f"{s3_prefix}/there.pt", b"x")
    poll = {"max_wait_time_in_seconds": 2, "wait_before_next_try_in_seconds": 0.1}
    there = uploader.check_remote_files_exist_async([f"{key}/there.pt"], **poll)
    assert there.result(WAIT_S) is Status.EXIST
    missing = uploader.check_remote_files_exist_async([f"{key}/there.pt", f"{key}/never.pt"], **poll)
    assert missing.result(WAIT_S) is Status.TIMEOUT
    uploader.is_remote_upload_failed.set()
    assert uploader.check_remote_files_exist_async([f"{key}/never.pt"], **poll).result(WAIT_S) is Status.ERROR
    uploader.futures.clear()
    pool = uploader.check_remote_files_exist_executor
    assert isinstance(pool, SmallChecks) and pool.executor.submit(eval, HEAVY_MODULES).result(WAIT_S) == []


@pytest.fixture
def s3_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Point this process's S3 client at an endpoint, one botocore attempt a request: an outage reaches the
    upload's own wait at once instead of after botocore's backoff."""

    def point(endpoint: str) -> None:
        monkeypatch.setenv("S3_ENDPOINT_URL", endpoint)
        monkeypatch.setattr(transfers, "BOTOCORE_ATTEMPTS", 1)
        storage._client.cache_clear()

    yield point
    monkeypatch.undo()
    storage._client.cache_clear()


def test_an_upload_into_an_outage_waits_it_out_and_says_so(
    s3_server: S3Server, s3_prefix: str, tmp_path: Path, s3_at: Callable[[str], None], caplog: Any
) -> None:
    local = tmp_path / "ep0-ba4-rank0.pt"
    local.write_bytes(b"weights")
    bucket, key = storage.split_s3(s3_prefix)
    with outage_proxy(s3_server.endpoint) as proxy, caplog.at_level(logging.WARNING):
        s3_at(proxy.endpoint)
        proxy.down(seconds=3)
        upload_to_s3(30, "s3", {"bucket": bucket}, f"{key}/{local.name}", str(local), overwrite=False)
    assert proxy.refused > 0 and not local.exists()
    assert f"uploading the checkpoint file {key}/{local.name}: S3 answered again after" in caplog.text
    s3_at(s3_server.endpoint)
    assert storage.read_bytes(f"{s3_prefix}/{local.name}") == b"weights"


def test_a_refused_upload_is_one_storage_error_naming_the_fix(
    s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "ep0-ba4-rank0.pt"
    local.write_bytes(b"weights")
    bucket, key = storage.split_s3(s3_prefix)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-known-key")
    storage._client.cache_clear()
    try:
        with pytest.raises(storage.StorageError, match="AWS_ACCESS_KEY_ID") as refused:
            upload_to_s3(30, "s3", {"bucket": bucket}, f"{key}/{local.name}", str(local), overwrite=True)
    finally:
        monkeypatch.undo()
        storage._client.cache_clear()
    assert not refused.value.transient and local.exists()  # at once, not waited on


def test_only_a_bare_s3_bucket_takes_the_small_path() -> None:
    """Other object stores, or S3 with settings shared.storage does not read, keep Composer's function."""
    assert is_plain_s3({"remote_backend_name": "s3", "backend_kwargs": {"bucket": "b"}})
    assert not is_plain_s3({"remote_backend_name": "s3", "backend_kwargs": {"bucket": "b", "prefix": "p"}})
    assert not is_plain_s3({"remote_backend_name": "gs", "backend_kwargs": {"bucket": "b"}})
