"""The encode job: plan, encode this rank's unfinished partitions, then (rank 0) publish a version.

Workers (encode/process/prepare.py) read, select, decode, resize and batch within a partition; this process
queues the VAE and text tower on the device a few batches ahead and writes rows (encode/process/writer.py).
Batches never span partitions, so the bytes of a sample do not depend on the worker or rank count.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from encode.config import EncodeConfig
from encode.plan.fingerprints import (
    DoneMarker,
    PartitionPlan,
    StageFingerprints,
    assign_to_rank,
    list_markers,
    plan_partitions,
    stage_fingerprints,
)
from encode.process.encoders import Encoders, HostArrays, load_encoders
from encode.process.prepare import PartitionEnd, PreparedBatch, PreparedSample, PreparedStream, keep_as_is
from encode.process.timing import MainThreadTimes
from encode.process.writer import PartitionWriter, remove_stale_staging
from encode.sources import Partition, SourceError, list_partitions
from shared.manifest import Layout
from shared.runtime.children import die_with_parent

log = logging.getLogger("encode")


@dataclass
class RankSummary:
    rank: int
    world_size: int
    partitions_total: int
    partitions_mine: int
    partitions_done_before: int
    markers: list[DoneMarker] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # partition -> error
    seconds: float = 0.0
    main_thread: dict[str, float] = field(default_factory=dict)  # MainThreadTimes.seconds
    main_thread_launch: dict[str, float] = field(default_factory=dict)  # MainThreadTimes.launch_parts
    device: dict[str, float] = field(default_factory=dict)  # DeviceTimeline.seconds: busy, idle

    @property
    def samples_written(self) -> int:
        return sum(out["num_samples"] for m in self.markers for out in m.outputs.values())

    @property
    def images_encoded(self) -> int:
        return sum(sum(m.encoded["latents"].values()) for m in self.markers)

    @property
    def samples_read(self) -> int:
        return sum(m.samples_read for m in self.markers)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int

    @classmethod
    def from_env(cls) -> RankInfo:
        """RANK / WORLD_SIZE as set by torchrun, Composer's launcher, or a Slurm array (see jobs/launch)."""
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


IN_FLIGHT_BATCHES = 3  # batches queued on the device while the host writes an earlier one's rows


@dataclass
class LaunchedBatch:
    """One batch with its text and VAE work queued on the device; `write` collects the results and writes
    the batch's rows, in input order."""

    writer: PartitionWriter
    samples: list[PreparedSample]
    text: tuple[list[int], HostArrays] | None  # samples without a reused text cell, and their cells
    latents: list[tuple[int, list[int], HostArrays]]  # (resolution, samples, their mean and logvar)
    spans: list[tuple[Any, Any]]  # each model call's marks on the device (DeviceTimeline)

    def write(self, times: MainThreadTimes) -> None:
        with times.phase("waiting_for_device"):
            cells = dict(zip(self.text[0], self.text[1].arrays()[0], strict=True)) if self.text else {}
            texts = [cells.get(i, s.text_embedding) for i, s in enumerate(self.samples)]
            latents = [dict(s.latents) for s in self.samples]
            for res, group, pending in self.latents:
                means, logvars = pending.arrays()
                for j, i in enumerate(group):
                    latents[i][res] = (means[j], logvars[j])
        times.device.account(self.spans)
        with times.phase("writing"):
            for i, sample in enumerate(self.samples):
                text = texts[i]
                assert text is not None  # each sample either reused its text cell or had it encoded
                self.writer.write(sample.key, sample.caption, text, latents[i], sample.geometry)


def launch_batch(
    writer: PartitionWriter, samples: list[PreparedSample], encoders: Encoders, times: MainThreadTimes
) -> LaunchedBatch:
    """Queue the text tower and the VAE (once per resolution and shape present) for one batch."""
    todo = [i for i, s in enumerate(samples) if s.text_embedding is None]
    text, spans = None, []
    if todo:
        captions = [samples[i].text_input for i in todo]
        with times.launch_part("text"), times.on_device(spans):
            text = (todo, encoders.launch_text(captions, writer.cfg.text.store))
    writer.count("text", reused=False, n=len(todo))
    writer.count("text", reused=True, n=len(samples) - len(todo))
    latents = []
    for res in sorted({res for s in samples for res in (*s.pixels, *s.latents)}):
        # A bucketed resolution holds several shapes: the VAE runs once per shape present.
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(samples):
            if res in s.pixels:
                by_shape.setdefault(s.pixels[res].shape, []).append(i)
        for group in by_shape.values():
            with times.launch_part("pixel_batch"):
                host = encoders.pixel_batch([samples[i].pixels[res] for i in group])
            with times.launch_part("vae"), times.on_device(spans):
                latents.append((res, group, encoders.launch_vae(host)))
        writer.count(f"latents:{res}", reused=False, n=sum(len(g) for g in by_shape.values()))
        writer.count(f"latents:{res}", reused=True, n=sum(res in s.latents for s in samples))
    return LaunchedBatch(writer, samples, text, latents, spans)


def encode_partitions(
    plans: list[PartitionPlan],
    cfg: EncodeConfig,
    encoders: Encoders,
    layout: Layout,
    stages: StageFingerprints,
    summary: RankSummary,
) -> None:
    """Run the worker stream and write every partition in `plans`, publishing each as it completes.

    Up to IN_FLIGHT_BATCHES batches are queued on the device ahead of the one whose rows are being written,
    so the device works while the host receives the next batch and writes the last one.
    """
    import torch.utils.data

    shapes = {res: encoders.shapes(res, cfg.text.store) for res in cfg.transform.resolutions}
    by_id = {p.partition.id: p for p in plans}
    writers: dict[str, PartitionWriter] = {}
    in_flight: deque[LaunchedBatch] = deque()
    times = MainThreadTimes(encoders.device)
    loader = torch.utils.data.DataLoader(
        PreparedStream(plans, cfg),
        batch_size=None,
        num_workers=min(cfg.workers, len(plans)),
        collate_fn=keep_as_is,
        prefetch_factor=2 if cfg.workers else None,  # batches per worker
        worker_init_fn=die_with_parent,  # a kill -9 of this process leaves no worker behind
    )
    progress = Progress(len(plans), enabled=cfg.progress)
    try:
        with Publisher(cfg.output.max_pending_uploads, summary, progress) as publisher:
            for item in times.items(loader):
                pid = item.partition
                if pid not in writers:
                    writers[pid] = PartitionWriter(by_id[pid], cfg, layout, shapes)
                if isinstance(item, PreparedBatch):
                    with times.phase("launch"):
                        in_flight.append(launch_batch(writers[pid], item.samples, encoders, times))
                    while len(in_flight) > IN_FLIGHT_BATCHES:
                        in_flight.popleft().write(times)
                    continue
                writer = writers.pop(pid)
                while any(batch.writer is writer for batch in in_flight):  # FIFO: rows stay in input order
                    in_flight.popleft().write(times)
                with times.phase("publishing"):
                    finish_partition(writer, item, stages, summary, publisher)
    finally:  # a failed job: the open partitions' staged shards go (a rerun redoes them)
        for open_writer in writers.values():
            open_writer.discard()
    progress.close()
    summary.main_thread, summary.main_thread_launch = times.seconds, times.launch_parts
    summary.device = times.device.seconds()


def finish_partition(
    writer: PartitionWriter,
    end: PartitionEnd,
    stages: StageFingerprints,
    summary: RankSummary,
    publisher: Publisher,
) -> None:
    if end.error:
        writer.discard()
        if end.config_error:
            raise SourceError(end.error)
        summary.failed[end.partition] = end.error
        log.error("partition %s failed, will be retried on the next run: %s", end.partition, end.error)
        publisher.progress.update(summary)
        return
    publisher.submit(writer, end, stages)


class Publisher:
    """Publishes finished partitions (upload, then done-marker) on one background thread, so the device
    encodes the next partition while an upload runs.

    At most `max_pending` partitions wait or upload at once (submitting another first waits for the
    oldest), bounding the staged shards on disk. Each partition is still published by
    `PartitionWriter.publish`, whose marker is written only after its upload: kill -9 at any moment leaves
    each partition either marked done with all its shards in place or unmarked (redone on rerun). An
    upload error is raised in the main thread at the next submit or at the end, failing the job.
    """

    def __init__(self, max_pending: int, summary: RankSummary, progress: Progress):
        self.max_pending, self.summary, self.progress = max_pending, summary, progress
        self.pending: deque[Future[DoneMarker]] = deque()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="encode-publish") if max_pending else None

    def submit(self, writer: PartitionWriter, end: PartitionEnd, stages: StageFingerprints) -> None:
        if self.pool is None:
            self._done(writer.publish(end, stages))
            return
        self.pending.append(self.pool.submit(writer.publish, end, stages))
        while len(self.pending) > self.max_pending or (self.pending and self.pending[0].done()):
            self._done(self.pending.popleft().result())  # re-raises the upload's error here

    def _done(self, marker: DoneMarker) -> None:
        self.summary.markers.append(marker)
        self.progress.update(self.summary)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """Wait for every pending publish (a finished upload is kept even when the job fails); raise the
        first upload error unless the main thread is already raising."""
        if self.pool is None:
            return
        self.pool.shutdown(wait=True)
        errors = [f.exception() for f in self.pending]
        for future in self.pending:
            if future.exception() is None:
                self._done(future.result())
        self.pending.clear()
        first = next((e for e in errors if e is not None), None)
        if first is not None and exc_type is None:
            raise first


class Progress:
    """A tqdm bar over partitions with images/s and samples written (ETA from tqdm)."""

    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm

        self.start = time.perf_counter()
        self.bar = tqdm(total=total, unit="part", desc="encode", disable=not enabled or total == 0)

    def update(self, summary: RankSummary) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix(
            img_s=f"{summary.images_encoded / elapsed:.1f}",
            written=summary.samples_written,
            failed=len(summary.failed),
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def run_rank(
    cfg: EncodeConfig,
    rank: RankInfo,
    encoders: Encoders | None = None,
    partitions: list[Partition] | None = None,
) -> RankSummary:
    """Encode this rank's share of the unfinished partitions. Safe to rerun at any time."""
    start = time.perf_counter()
    partitions = partitions if partitions is not None else list_partitions(cfg.source)
    encoders = encoders or load_encoders(cfg)
    if not cfg.encoder.batch_size:  # 0: sized from the device's memory when the encoders were loaded
        sized = dataclasses.replace(cfg.encoder, batch_size=encoders.batch_size)
        cfg = dataclasses.replace(cfg, encoder=sized)
    layout = Layout(cfg.output.uri)
    stages = stage_fingerprints(cfg, encoders.ids)
    mine = plan_partitions(
        assign_to_rank(partitions, rank.rank, rank.world_size), stages, layout, list_markers(layout)
    )
    todo = [p for p in mine if not p.is_done]
    summary = RankSummary(rank.rank, rank.world_size, len(partitions), len(mine), len(mine) - len(todo))
    # All of this rank's partitions, done ones too: a kill between a partition's done-marker and the
    # removal of its staging folder (the marker is written last, the folder removed after it) leaves the
    # folder of a partition that is already done.
    remove_stale_staging(layout, [p.partition.id for p in mine])
    if todo:
        log.info(
            "rank %d/%d: %d of its %d partitions to encode", rank.rank, rank.world_size, len(todo), len(mine)
        )
        encode_partitions(todo, cfg, encoders, layout, stages, summary)
    summary.seconds = time.perf_counter() - start
    return summary


def rejected_total(markers: list[DoneMarker]) -> Counter[str]:
    total: Counter[str] = Counter()
    for marker in markers:
        total.update(marker.rejected)
    return total
