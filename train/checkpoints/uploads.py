"""Checkpoint uploads to an s3:// save folder that wait out an S3 outage in the background.

Composer's CheckpointSaver hands each checkpoint file (and then the `latest` pointer) to its RemoteUploader,
whose worker processes make botocore's few attempts; a failed upload is raised in the training loop at the
next batch. A 60 s outage at a checkpoint therefore stopped the run at its next step, and that checkpoint
never reached S3 (shared/storage/outage.py has the numbers). Here the uploader's workers run Composer's own
upload function under `wait_out_outages` for up to resilience.outage_patience_s, while training goes on; a
refusal (AccessDenied, a missing bucket) still fails at once, and an outage longer than the patience fails
as an outage (train/cli.py: exit 1, the supervisor restarts from the last checkpoint that did arrive).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from shared.storage.outage import wait_out_outages

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # train/cli.py's


def upload_patiently(patience_s: float, **upload: Any) -> int:
    """Composer's `_upload_file_to_object_store(**upload)`, repeated while S3 fails as in an outage. Runs in
    the uploader's worker processes (spawned: a module-level function of a module they can import)."""
    from composer.utils.remote_uploader import _upload_file_to_object_store

    if not logging.getLogger().handlers:  # a spawned worker: its warnings as the rank's own lines read
        logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    what = f"uploading the checkpoint file {upload.get('remote_file_name')}"
    return wait_out_outages(lambda: _upload_file_to_object_store(**upload), what, patience_s)


class PatientUploads:
    """Stands in for a RemoteUploader's `upload_executor`: what Composer submits to it runs under
    `upload_patiently`. Everything else (the workers, shutdown) is the executor's."""

    def __init__(self, executor: Any, patience_s: float):
        self.executor, self.patience_s = executor, patience_s

    def submit(self, fn: Any, /, **kwargs: Any) -> Future:
        from composer.utils.remote_uploader import _upload_file_to_object_store

        if fn is not _upload_file_to_object_store:  # a Composer that uploads another way: leave it be
            return self.executor.submit(fn, **kwargs)
        return self.executor.submit(upload_patiently, self.patience_s, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executor, name)


def upload_patiently_from(saver: Any, patience_s: float) -> None:
    """Make the CheckpointSaver's uploads (an s3:// save folder) wait out outages; a no-op without one."""
    uploader = getattr(saver, "remote_uploader", None)
    if uploader is not None and not isinstance(uploader.upload_executor, PatientUploads):
        uploader.upload_executor = PatientUploads(uploader.upload_executor, patience_s)
