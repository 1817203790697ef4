"""Write one partition's rows with MDSWriter into staging, then publish atomically and mark it done.

Publishing order is what makes kill -9 safe at any moment: (1) shards are written to a staging folder,
(2) moved (local: one rename) or uploaded (S3) to a folder named by the output fingerprint, which no
published version references yet, (3) the done-marker is written with one atomic PUT/rename. A run killed
before (3) leaves no marker, so the partition is redone from scratch and its folder overwritten.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import stat
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from encode.config import EncodeConfig
from encode.plan.fingerprints import DoneMarker, PartitionPlan, StageFingerprints
from encode.process.prepare import Geometry, PartitionEnd
from shared import contract, storage
from shared.buckets import bucket_name
from shared.launch import control
from shared.manifest import INDEX_NAME, Layout, fingerprint
from shared.presets import get_preset

STALE_STAGING_S = 24 * 3600  # another host's staging folder in a shared output: a day untouched is dead
_STAGING_TRIES = 20  # each retry needs another process's rmdir in a window of microseconds


def staging_root(layout: Layout) -> Path:
    """Local outputs stage beside the data so publishing is a same-filesystem rename; S3 outputs stage in
    `<tmp>/sd-encode-staging-<uid>`, private to this user (a fixed shared path could be planted)."""
    if storage.is_s3(layout.root):
        return storage.private_temp_dir("sd-encode-staging", "TMPDIR (the environment variable)")
    return Path(layout.root) / "_staging"


def make_staging_folder(layout: Layout, name: str) -> Path:
    """Create `<staging root>/<name>` for one writer alone.

    The root is shared by every process encoding into this output (Slurm array tasks, hosts on one file
    system, this process's publishing thread) and each removes it on its way out when it is empty: a
    removal between the root's creation and our mkdir is retried here, never answered with mkdir(parents=
    True), which would recreate an S3 output's private root without its mode 0700.
    """
    for attempt in range(_STAGING_TRIES):
        try:  # an S3 output's root is checked after its mkdir (private_temp_dir): gone by then is retried too
            root = staging_root(layout)
            if not storage.is_s3(layout.root):
                make_root(root)
            (root / name).mkdir()
            return root / name
        except FileNotFoundError:
            if attempt == _STAGING_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def make_root(root: Path) -> None:
    """mkdir of a root other processes remove when empty. Not pathlib's exist_ok=True: on EEXIST it asks
    is_dir() afterwards and raises FileExistsError when the folder was removed in between (CI: one task of
    three, in a run of 300). Whether the root is still there is the next mkdir's answer."""
    with contextlib.suppress(FileExistsError):
        root.mkdir(parents=True)


def remove_staging_root_if_empty(root: Path) -> None:
    """rmdir is the whole check: the kernel refuses a folder another writer has just put its folder in,
    where a listdir-then-rmdir let a task of a Slurm array stop on "Directory not empty" (CI, 2 tasks)."""
    try:
        root.rmdir()
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise


def staging_prefix(layout: Layout, partition_id: str) -> str:
    """The name every staging folder of this job's partition starts with: `<hash of output.uri>.<id>.`.

    Staging roots can be shared by several encode jobs (all S3 outputs of a user share one), so a folder
    is ours only if it names both our output and our partition.
    """
    return f"{fingerprint(layout.root.rstrip('/'))[:12]}.{partition_id}."


def staging_owner() -> str:
    """`<host hash>-<pid>-<process start>`: which process a staging folder is writing for."""
    pid = os.getpid()
    return f"{fingerprint(socket.gethostname())[:6]}-{pid}-{control.process_start(pid) or 0}"


def owner_is_gone(name: str, age_s: float) -> bool:
    """Whether the process a staging folder's name records has ended: one on this host by its pid and start
    time; one on another host (a shared output folder) once the folder is STALE_STAGING_S old. A name
    without an owner (written before this was recorded) is a killed run's."""
    parts = name.rsplit(".", 2)
    owner = parts[-2].split("-") if len(parts) == 3 else []
    if len(owner) != 3 or not all(p.isalnum() for p in owner):
        return True
    host, pid, start = owner
    if host != fingerprint(socket.gethostname())[:6]:
        return age_s > STALE_STAGING_S
    return not (pid.isdigit() and start.isdigit() and control.is_running(int(pid), int(start)))


def remove_stale_staging(layout: Layout, partition_ids: list[str]) -> None:
    """Drop staging folders a killed run left for these partitions; folders of other jobs or partitions,
    and those of a live process (another encode of the same output started beside this one: its staged
    shards were deleted under it, and it stopped with "No such file" halfway), are never touched."""
    root = staging_root(layout)
    try:  # another process sharing the root may remove it, or a folder in it, while we look
        names = os.listdir(root)
    except FileNotFoundError:
        return
    prefixes = tuple(staging_prefix(layout, pid) for pid in partition_ids)
    for folder in (root / name for name in names if name.startswith(prefixes)):
        try:
            info = folder.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(info.st_mode) and owner_is_gone(folder.name, time.time() - info.st_mtime):
            shutil.rmtree(folder, ignore_errors=True)


class PartitionWriter:
    """One MDSWriter per resolution for one partition (per bucket of a bucketed resolution, opened at its
    first row: `<staging>/<res>/<HxW>/`); rows arrive in input order."""

    def __init__(
        self,
        plan: PartitionPlan,
        cfg: EncodeConfig,
        layout: Layout,
        shapes: dict[int, contract.Shapes],
    ):
        self.plan, self.cfg, self.layout, self.shapes = plan, cfg, layout, shapes
        self.started = time.perf_counter()
        self.rows: Counter[tuple[int, str | None]] = Counter()
        self.encoded: Counter[str] = Counter()
        self.reused: Counter[str] = Counter()
        self.finished = False
        self.bucketed = set(cfg.transform.bucket_lists(cfg.filter.max_aspect_ratio))
        self.factor = get_preset(cfg.preset).vae_downsample
        name = f"{staging_prefix(layout, plan.partition.id)}{staging_owner()}.{uuid.uuid4().hex[:8]}"
        self.staging = make_staging_folder(layout, name)
        self.writers = {
            (res, None): self._open(self.staging / str(res), shapes[res])
            for res in shapes
            if res not in self.bucketed
        }

    def _open(self, out: Path, shapes: contract.Shapes) -> Any:
        from streaming import MDSWriter

        return MDSWriter(
            out=str(out),
            columns=contract.mds_columns(shapes),
            compression=self.cfg.output.compression,
            size_limit=self.cfg.output.shard_size_limit,
            hashes=[contract.SHARD_HASH],  # train verifies each shard against it on first read
            exist_ok=True,
        )

    def write(
        self,
        key: str,
        caption: str,
        text_embedding: np.ndarray,
        latents: dict[int, tuple[np.ndarray, np.ndarray]],
        geometry: dict[int, Geometry] | None = None,
    ) -> None:
        for res, (mean, logvar) in latents.items():
            if res not in self.bucketed:
                self.writers[(res, None)].write(contract.make_row(key, caption, mean, logvar, text_embedding))
                self.rows[(res, None)] += 1
                continue
            bucket, size, box = (geometry or {})[res]
            slot = (res, bucket_name(bucket))
            if slot not in self.writers:
                shapes = self.shapes[res].for_bucket(bucket, self.factor)
                self.writers[slot] = self._open(self.staging / str(res) / slot[1], shapes)
            row = contract.make_row(key, caption, mean, logvar, text_embedding, (size, box))
            self.writers[slot].write(row)
            self.rows[slot] += 1

    def count(self, stage: str, reused: bool, n: int = 1) -> None:
        (self.reused if reused else self.encoded)[stage] += n

    def publish(self, end: PartitionEnd, stages: StageFingerprints) -> DoneMarker:
        """Finish shards, move them into place, then write the done-marker (the commit point). A failed
        publish (an upload error) removes the staged shards: without a marker the rerun redoes the
        partition anyway, and each held up to a partition's worth of disk in the temp folder."""
        try:
            return self._publish(end, stages)
        except BaseException:
            self.discard()
            raise

    def _publish(self, end: PartitionEnd, stages: StageFingerprints) -> DoneMarker:
        for writer in self.writers.values():
            writer.finish()
        self.finished = True
        outputs = {res: self._publish_resolution(res) for res in self.shapes}
        marker = DoneMarker(
            partition=self.plan.partition.id,
            recipe=self.plan.recipe,
            source=self.plan.source,
            select=stages.select,
            text=stages.text,
            image=dict(stages.image),
            outputs=outputs,
            samples_read=end.samples_read,
            rejected=dict(end.rejected),
            admitted_unchecked=dict(end.admitted_unchecked),
            smaller_than_resolution={res: end.smaller_than_resolution.get(res, 0) for res in self.shapes},
            encoded=_counts(self.encoded),
            reused=_counts(self.reused),
            seconds=round(time.perf_counter() - self.started, 3),
            finished=datetime.now(UTC).isoformat(timespec="microseconds"),
        )
        storage.write_json(self.layout.done_marker(marker.partition, marker.recipe), marker.to_json())
        self.discard()
        return marker

    def _publish_resolution(self, res: int) -> dict[str, object]:
        """Move one resolution's shards into place. The marker keeps their index entries, so publishing
        a version never re-reads tens of thousands of partition indexes."""
        local = self.staging / str(res)
        if res in self.bucketed:
            return self._publish_buckets(res, local)
        if not self.rows[(res, None)]:
            return {"dir": None, "num_samples": 0, "bytes": 0, "shards": []}
        size = sum(p.stat().st_size for p in local.iterdir() if p.is_file())
        shards = json.loads((local / INDEX_NAME).read_text())["shards"]
        dirname = self.plan.outputs[res]
        _put_in_place(local, self.layout.partition_output(res, dirname))
        return {"dir": dirname, "num_samples": self.rows[(res, None)], "bytes": size, "shards": shards}

    def _publish_buckets(self, res: int, local: Path) -> dict[str, object]:
        """A bucketed resolution: one sub-folder per bucket with rows, uploaded as one partition output."""
        buckets: dict[str, dict[str, object]] = {}
        for (r, name), count in sorted(self.rows.items(), key=lambda kv: str(kv[0])):
            if r != res or name is None or not count:
                continue
            folder = local / name
            size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
            shards = json.loads((folder / INDEX_NAME).read_text())["shards"]
            buckets[name] = {"num_samples": count, "bytes": size, "shards": shards}
        total = sum(int(b["num_samples"]) for b in buckets.values())  # type: ignore[call-overload]
        if not total:
            return {"dir": None, "num_samples": 0, "bytes": 0, "shards": [], "buckets": {}}
        dirname = self.plan.outputs[res]
        _put_in_place(local, self.layout.partition_output(res, dirname))
        size = sum(int(b["bytes"]) for b in buckets.values())  # type: ignore[call-overload]
        return {"dir": dirname, "num_samples": total, "bytes": size, "shards": [], "buckets": buckets}

    def discard(self) -> None:
        if not self.finished:  # close the writers' threads and files before deleting what they wrote
            for writer in self.writers.values():
                writer.finish()
            self.finished = True
        shutil.rmtree(self.staging, ignore_errors=True)
        remove_staging_root_if_empty(self.staging.parent)


def _put_in_place(local: Path, uri: str) -> None:
    """Move a partition output into place, unless the same one is there already: its name is its output
    fingerprint, so a rerun for another resolution writes this one again identically, and replacing a local
    folder deletes it first, under the trainers of the version that publishes it (S3 overwrites each object
    at once, so there it is simply uploaded again)."""
    if not storage.is_s3(uri) and _same_files(local, Path(uri)):
        return  # the staging copy goes with the partition's staging folder
    storage.upload_dir(local, uri)


def _same_files(local: Path, target: Path) -> bool:
    """Every file of `local` is in `target` with its size, and every MDS index byte for byte."""
    files = [p for p in local.rglob("*") if p.is_file()]
    for path in files:
        there = target / path.relative_to(local)
        if not there.is_file() or there.stat().st_size != path.stat().st_size:
            return False
        if path.name == INDEX_NAME and there.read_bytes() != path.read_bytes():
            return False
    return bool(files)


def _counts(counter: Counter[str]) -> dict[str, object]:
    latents = {k.split(":")[1]: v for k, v in counter.items() if k.startswith("latents:")}
    return {"text": counter.get("text", 0), "latents": latents}
