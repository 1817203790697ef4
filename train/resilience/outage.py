"""A run that starts while S3 is down waits for it before it reads anything.

A restart after an S3 outage (the supervisor's, torchrun's, a Slurm requeue) used to begin at once and fail
again on its first read (the manifest, `latest`, the checkpoint) for as long as the outage lasted, each
failure spending a restart: with the default budget a few minutes of outage ended an unattended run (the
supervisor's crash-loop rule stops at the second failure at one step). Here every rank first asks each S3
bucket the run reads or writes whether it answers, waiting the outage out for up to
resilience.outage_patience_s (shared/storage/outage.py: backoff from 2 s to 60 s, with jitter). Past that the
run stops as a resumable one (exit 75; under a supervisor its `resumable` record): nothing trained since the
last checkpoint is lost, and a rerun or a Slurm requeue tries again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shared import storage
from shared.launch import control
from shared.storage.outage import s3_answers, wait_out_outages
from train.resilience.exits import record_exit

if TYPE_CHECKING:
    from train.config import TrainConfig

log = logging.getLogger(__name__)


class StorageOutageStop(Exception):
    """S3 did not answer within resilience.outage_patience_s at the run's start: rerun (exit 75)."""


def s3_buckets(cfg: TrainConfig) -> list[str]:
    """One s3:// URI per bucket the run reads or writes (data, a mix's streams, eval, save and load)."""
    uris = [cfg.data.uri, *(stream.uri for stream in cfg.data.streams), cfg.eval.uri, cfg.save_folder]
    uris += [cfg.load_path, cfg.model.init_from]
    buckets: dict[str, str] = {}
    for uri in uris:
        if uri and storage.is_s3(uri):
            bucket, _ = storage.split_s3(uri)
            buckets.setdefault(bucket, f"{storage.S3_SCHEME}{bucket}")
    return list(buckets.values())


def wait_for_s3(cfg: TrainConfig) -> None:
    """Return once every bucket of the run answers; StorageOutageStop when one does not within the
    patience (recorded for the supervisor as a resumable stop)."""
    patience = cfg.resilience.outage_patience_s
    for bucket in s3_buckets(cfg):
        try:
            wait_out_outages(lambda b=bucket: s3_answers(b), f"starting: {bucket}", patience)
        except storage.StorageError as err:
            if not err.transient:
                raise
            stop = StorageOutageStop(
                f"{err}; nothing trained since the last checkpoint is lost: rerun the same command once S3 "
                f"answers (exit code {control.EXIT_RESUMABLE}; a Slurm job requeues itself)"
            )
            record_exit("resumable", -1, str(stop))
            raise stop from None
