"""Checkpoint uploads to an s3:// save folder: they wait out an S3 outage in the background, and the processes
that make them stay small.

Composer's CheckpointSaver hands each checkpoint file (and then the `latest` pointer) to its RemoteUploader,
whose worker processes make botocore's few attempts; a failed upload is raised in the training loop at the
next batch. A 60 s outage at a checkpoint therefore stopped the run at its next step, and that checkpoint
never reached S3 (shared/storage/outage.py has the numbers). Here each upload runs under `wait_out_outages`
for up to resilience.outage_patience_s, while training goes on; a refusal (AccessDenied, a missing bucket)
still fails at once, as a StorageError naming the fix, and an outage longer than the patience fails as an
outage (train/cli.py: exit 1, the supervisor restarts from the last checkpoint that did arrive).

Process cost: the uploader spawns its workers (spawn, not fork: the rank holds CUDA), and each worker imports
the function it runs. Composer's upload function lives in Composer, so every worker imported all of Composer
and torch: on the tiny run's rank 0, three such processes (the upload worker and two that poll for the files
`latest` waits on) of ~700 MB resident and ~13 s of CPU each on a 2-core box, per saving rank and restart.
For an s3:// folder the workers now run `upload_to_s3` and `wait_for_files_on_s3` (shared.storage and
boto3; no torch): ~70 MB and ~1 s of CPU each. Other object stores keep Composer's functions.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from shared.storage.outage import wait_out_outages

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # train/cli.py's
# Composer's stagger of uploads by local rank (remote_uploader.py), kept for the uploads made here.
STAGGER_ENV = "COMPOSER_LOCAL_RANK_STAGGER_SECONDS"


def upload_patiently(patience_s: float, **upload: Any) -> int:
    """Composer's `_upload_file_to_object_store(**upload)`, repeated while S3 fails as in an outage. Runs in
    the uploader's worker processes (spawned: a module-level function of a module they can import)."""
    if not logging.getLogger().handlers:  # a spawned worker: its warnings as the rank's own lines read
        logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    if is_plain_s3(upload):
        return upload_to_s3(patience_s, **upload)
    from composer.utils.remote_uploader import _upload_file_to_object_store

    what = f"uploading the checkpoint file {upload.get('remote_file_name')}"
    return wait_out_outages(lambda: _upload_file_to_object_store(**upload), what, patience_s)


def is_plain_s3(upload: dict[str, Any]) -> bool:
    """An upload to S3 with nothing set but the bucket (what an s3:// save_folder gives): shared.storage
    reaches it as Composer's S3ObjectStore would (S3_ENDPOINT_URL, the environment's credentials)."""
    return upload.get("remote_backend_name") == "s3" and set(upload.get("backend_kwargs") or {}) == {"bucket"}


def upload_to_s3(
    patience_s: float,
    remote_backend_name: str,
    backend_kwargs: dict[str, Any],
    remote_file_name: str,
    local_file_path: str,
    overwrite: bool,
    num_attempts: int = 1,
) -> int:
    """What Composer's upload function does for S3 (refuse an existing object unless `overwrite`, upload,
    remove the staged copy), without importing Composer or torch. As there, each try is one botocore call
    (its own retries, which stand in for Composer's `num_attempts`), and an outage is waited out for
    `patience_s`, with one line when S3 answers again. A refusal is a StorageError naming the fix."""
    from shared import storage

    del remote_backend_name, num_attempts
    bucket, client = backend_kwargs["bucket"], storage.s3_client()
    uri = f"s3://{bucket}/{remote_file_name}"
    what = f"uploading the checkpoint file {remote_file_name}"
    time.sleep(int(os.environ.get("LOCAL_RANK", "0")) * int(os.environ.get(STAGGER_ENV, "0")))
    try:
        if not overwrite and wait_out_outages(
            lambda: s3_has(client, bucket, remote_file_name), what, patience_s
        ):
            raise FileExistsError(
                f"Object {remote_file_name} already exists, but overwrite was set to False. "
                "Please set `save_overwrite` to `True` in Trainer to overwrite the existing file."
            )
        upload = lambda: client.upload_file(local_file_path, bucket, remote_file_name)  # noqa: E731
        wait_out_outages(upload, what, patience_s)
    except (FileExistsError, storage.StorageError):
        raise
    except Exception as err:
        raise storage.s3_error(err, uri) from None
    os.remove(local_file_path)
    return 0


def s3_has(client: Any, bucket: str, key: str) -> bool:
    """One HEAD: whether the object is there (an error other than "missing" is raised). Not storage.exists:
    its own repeats and warnings would sit inside the callers' outage wait and the quiet poll."""
    from shared.storage.errors import is_missing

    try:
        client.head_object(Bucket=bucket, Key=key)
    except Exception as err:
        if is_missing(err):
            return False
        raise
    return True


@dataclass(frozen=True)
class FilesCheck:
    """Composer's RemoteFilesExistingCheckStatus, by value: it pickles as Composer's enum, so the worker that
    makes it needs no Composer, and the rank that reads the result gets Composer's own member."""

    value: int

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return composer_check_status, (self.value,)


EXIST, TIMEOUT, ERROR = FilesCheck(1), FilesCheck(2), FilesCheck(3)  # Composer's values


def composer_check_status(value: int) -> Any:
    from composer.utils.remote_uploader import RemoteFilesExistingCheckStatus

    return RemoteFilesExistingCheckStatus(value)


def wait_for_files_on_s3(
    remote_backend_name: str,
    backend_kwargs: dict[str, Any],
    remote_checkpoint_file_names: list[str],
    main_process_pid: int,
    is_remote_upload_failed: Any,
    max_wait_time_in_seconds: float = 3600,
    wait_before_next_try_in_seconds: float = 30,
) -> FilesCheck:
    """Composer's `_check_remote_files_exists` for S3 without Composer: wait until every file is in the
    bucket (EXIST, then Composer uploads `latest`), an upload failed or the rank is gone (ERROR), or the
    wait ran out (TIMEOUT)."""
    from shared import storage
    from shared.launch.ranks import alive

    del remote_backend_name
    bucket, client = backend_kwargs["bucket"], storage.s3_client()
    started = time.monotonic()
    for name in remote_checkpoint_file_names:
        while True:
            if is_remote_upload_failed.is_set() or not alive(main_process_pid):
                return ERROR
            try:
                if s3_has(client, bucket, name):
                    break
            except Exception as err:  # asked again at the next try, quietly, as Composer does
                logging.getLogger(__name__).debug("checking s3://%s/%s: %s", bucket, name, err)
            time.sleep(wait_before_next_try_in_seconds)
            if time.monotonic() - started > max_wait_time_in_seconds:
                return TIMEOUT
    return EXIST


class ExecutorStandIn:
    """Holds one of a RemoteUploader's executors: what Composer submits may run as another function
    (`submit`); everything else (the workers, shutdown) is the executor's."""

    def __init__(self, executor: Any):
        self.executor = executor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executor, name)


class PatientUploads(ExecutorStandIn):
    """Stands in for a RemoteUploader's `upload_executor`: its uploads run under `upload_patiently`."""

    def __init__(self, executor: Any, patience_s: float):
        super().__init__(executor)
        self.patience_s = patience_s

    def submit(self, fn: Any, /, **kwargs: Any) -> Future:
        from composer.utils.remote_uploader import _upload_file_to_object_store

        if fn is not _upload_file_to_object_store:  # a Composer that uploads another way: leave it be
            return self.executor.submit(fn, **kwargs)
        return self.executor.submit(upload_patiently, self.patience_s, **kwargs)


class SmallChecks(ExecutorStandIn):
    """Stands in for a RemoteUploader's `check_remote_files_exist_executor`: Composer's poll for S3 runs as
    `wait_for_files_on_s3`."""

    def submit(self, fn: Any, /, **kwargs: Any) -> Future:
        from composer.utils.remote_uploader import _check_remote_files_exists

        if fn is not _check_remote_files_exists or not is_plain_s3(kwargs):
            return self.executor.submit(fn, **kwargs)
        return self.executor.submit(wait_for_files_on_s3, **kwargs)


def upload_patiently_from(saver: Any, patience_s: float) -> None:
    """Make the CheckpointSaver's uploads (an s3:// save folder) wait out outages, and its uploads and polls
    run in worker processes that import no torch; a no-op without one."""
    uploader = getattr(saver, "remote_uploader", None)
    if uploader is not None and not isinstance(uploader.upload_executor, PatientUploads):
        uploader.upload_executor = PatientUploads(uploader.upload_executor, patience_s)
        uploader.check_remote_files_exist_executor = SmallChecks(uploader.check_remote_files_exist_executor)
