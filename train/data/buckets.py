"""Bucket-homogeneous batches: a bucketed resolution is read as one Streaming stream per bucket, batched
with Streaming's own `per_stream` (or `device_per_stream`) method, so every batch (every microbatch on every
rank) holds one latent shape and a resume is exactly as Streaming's (epoch, sample in epoch) state makes it.

Buckets are drawn in proportion to their sample counts over an epoch: each bucket stream gives all its
samples (no weight), or its share of its dataset's weight in a `data.streams` mix (`split_weight`).
`per_stream` batching drops each stream's last partial global batch per epoch and refuses a stream with
less than one global batch (ValueError deep inside Streaming), so buckets that small are left out here,
with a warning that names them (`usable_buckets`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.buckets import landscape_and_portrait
from shared.contract import SHARD_HASH
from train.data.streaming_host import DataError

if TYPE_CHECKING:
    from train.data.loader import PinnedData
    from train.data.mix import PinnedStream

log = logging.getLogger(__name__)

BUCKET_METHODS = ("per_stream", "device_per_stream")  # the batching methods that keep batches one shape


@dataclass(frozen=True)
class StreamLabel:
    """What one Streaming stream is: its dataset of a data.streams mix ("" without a mix) and its bucket
    ("" for a square-only resolution). Per-stream counts are summed by these (train/data/stream_counts.py)."""

    dataset: str
    bucket: str

    @property
    def key(self) -> str:
        """Its name in a checkpoint's counts: the dataset name as before buckets, `<dataset>/<HxW>` with."""
        return "/".join(p for p in (self.dataset, self.bucket) if p)


def is_bucketed(pinned: list[PinnedData]) -> bool:
    return any(p.buckets for p in pinned)


def batching_method(requested: str, bucketed: bool) -> str:
    """The Streaming batching method: the configured one, or `per_stream` for bucketed data whose configured
    method would mix shapes in a batch (random / stratified)."""
    if not bucketed or requested in BUCKET_METHODS:
        return requested
    log.info("bucketed data: data.batching_method=%s mixes shapes in a batch; using per_stream", requested)
    return "per_stream"


Entry = tuple[str, "PinnedData", "tuple[str, float | int] | None"]  # (dataset name, its data, weight)


def bucket_counts(pinned: PinnedData) -> dict[str, int]:
    """Samples stored in each bucket of a bucketed dataset (its manifest's counts)."""
    info = pinned.manifest.resolutions[pinned.resolution]
    return {name: (info.buckets or {})[name]["num_samples"] for name in pinned.buckets}


def usable_buckets(pinned: PinnedData, global_batch: int, warn: bool = True) -> dict[str, str]:
    """The buckets with at least one global batch of samples (Streaming's per_stream needs that)."""
    counts = bucket_counts(pinned)
    small = sorted(name for name, n in counts.items() if n < global_batch)
    if small and warn:
        log.warning(
            "%s: bucket(s) %s hold fewer samples than one global batch (%d) and are not trained on (%s of "
            "%d samples); encode more data or lower global_batch_size",
            pinned.root, ", ".join(small), global_batch, sum(counts[n] for n in small), pinned.num_samples,
        )  # fmt: skip
    return {name: local for name, local in pinned.buckets.items() if name not in small}


def split_weight(weight: tuple[str, float | int] | None, counts: list[int]) -> list[dict[str, Any]]:
    """A dataset's Streaming weight spread over its buckets in proportion to their sample counts: a
    proportion or a choose is shared out (choose by largest remainder, so the total stays exact); a repeat
    applies to every bucket as it is."""
    if weight is None:
        return [{} for _ in counts]
    kind, value = weight
    if kind == "repeat":
        return [{"repeat": value} for _ in counts]
    total = sum(counts) or 1
    if kind == "proportion":
        return [{"proportion": value * n / total} for n in counts]
    exact = [value * n / total for n in counts]
    chosen = [int(x) for x in exact]
    by_remainder = sorted(range(len(counts)), key=lambda i: exact[i] - chosen[i], reverse=True)
    for i in by_remainder[: int(value) - sum(chosen)]:
        chosen[i] += 1
    return [{"choose": c} for c in chosen]


def split_streams(
    entries: list[Entry], global_batch: int, warn: bool = True
) -> Iterator[tuple[str, PinnedData, str, str, int, dict[str, Any]]]:
    """(dataset name, its data, bucket ("" for square-only data), local cache folder, stored samples, its
    Streaming weight) of every stream a run reads: one per bucket with samples of a bucketed dataset, one
    for a square-only one."""
    for name, pinned, weight in entries:
        if not pinned.buckets:
            yield name, pinned, "", pinned.local, pinned.num_samples, split_weight(weight, [1])[0]
            continue
        usable = usable_buckets(pinned, global_batch, warn)
        stored = bucket_counts(pinned)
        for (bucket, local), extra in zip(
            usable.items(), split_weight(weight, [stored[b] for b in usable]), strict=True
        ):
            yield name, pinned, bucket, local, stored[bucket], extra


def bucket_streams(
    entries: list[Entry],
    global_batch: int,
    download_timeout: float,
) -> tuple[list[Any], list[StreamLabel]]:
    """Streaming `Stream`s and their labels for (dataset name, pinned data, weight) entries: split_streams."""
    from streaming import Stream

    streams, labels = [], []
    for name, pinned, bucket, local, _, extra in split_streams(entries, global_batch):
        hashed = SHARD_HASH if pinned.hashed else None
        streams.append(
            Stream(
                remote=pinned.remote,
                local=local,
                download_timeout=download_timeout,
                validate_hash=hashed,
                **extra,
            )
        )
        labels.append(StreamLabel(name, bucket))
    if not streams:
        raise DataError(
            f"no bucket holds one global batch ({global_batch} samples); encode more data, use fewer "
            "buckets (transform.buckets) or lower global_batch_size"
        )
    return streams, labels


def stream_entries(pinned: PinnedData, mix: list[PinnedStream]) -> list[Entry]:
    """(name, pinned data, weight) of each dataset a run reads: every stream of a mix, or the one dataset."""
    return [(s.name, s.pinned, s.cfg.weight()) for s in mix] or [("", pinned, None)]


def check_bucket_epochs(
    entries: list[Entry],
    global_batch: int,
    epoch_size: int | None,
    seed: int,
) -> None:
    """Refuse, before any model is built, a bucket stream that a weighted mix (or data.epoch_size) gives
    less than one global batch an epoch: Streaming's per_stream batching stops on it mid-start."""
    from train.data.mix import epoch_counts

    if not is_bucketed([pinned for _, pinned, _ in entries]):
        return
    names, weights, sizes = [], [], []
    for name, pinned, bucket, _, size, extra in split_streams(entries, global_batch, warn=False):
        names.append(" ".join(p for p in (name or pinned.root, bucket and f"bucket {bucket}") if p))
        weights.append(next(iter(extra.items()), None))
        sizes.append(size)
    got = epoch_counts(weights, sizes, epoch_size, seed)
    short = [f"{n}: {c} samples" for n, c in zip(names, got, strict=True) if c < global_batch]
    if short:
        raise DataError(
            f"bucketed data: each bucket is a stream that needs one global batch ({global_batch}) an epoch, "
            f"and its weight in the mix gives fewer ({'; '.join(short)}): raise that dataset's proportion "
            "(or choose / repeat, or data.epoch_size), encode more data, or lower global_batch_size"
        )


def run_streams(
    method: str,
    pinned: PinnedData,
    mix: list[PinnedStream],
    global_batch: int,
    download_timeout: float,
) -> tuple[list[Any] | None, list[StreamLabel], str]:
    """(Streaming streams or None for one plain stream, their labels, the batching method) of a run: a
    data.streams mix, a bucketed dataset, or both (each mixed dataset split into its buckets)."""
    from train.data.mix import streams_to_streaming

    bucketed = is_bucketed([s.pinned for s in mix] or [pinned])
    method = batching_method(method, bucketed)
    if not bucketed:
        if not mix:
            return None, [], method
        return streams_to_streaming(mix, download_timeout), [StreamLabel(s.name, "") for s in mix], method
    streams, labels = bucket_streams(stream_entries(pinned, mix), global_batch, download_timeout)
    return streams, labels, method


def sample_buckets(pinned: list[PinnedData]) -> dict[str, tuple[int, int, int]]:
    """ "HxW" -> latent shape of the landscape and the portrait bucket with the most samples in the run's
    (first bucketed) data, which sample grids render besides the square; {} for square-only data."""
    for data in pinned:
        info = data.manifest.resolutions[data.resolution]
        if not data.buckets or not info.buckets:
            continue
        shapes = info.bucket_shapes(data.resolution)
        counts = {name: info.buckets[name]["num_samples"] for name in data.buckets}
        return {name: shapes[name].latent for name in landscape_and_portrait(counts)}
    return {}


def compile_per_bucket(num_buckets: int, compile: bool) -> str:
    """With compile=true on bucketed data: one static graph per bucket shape, bounded.

    By default dynamo meets the second bucket's shape by recompiling a dynamic-shape graph (automatic
    dynamic shapes): one recompile, but kernels generated for symbolic sizes, which inductor tunes less well
    than static ones, and a third shape may specialise again. With a handful of buckets, a static graph per
    bucket is the better trade (cuDNN's benchmark also times each bucket's convolutions once): automatic
    dynamic shapes off, dynamo's per-code-object recompile limit (whatever the FSDP layout needed,
    train/model/kernels.py) times the bucket count. Returns the log line ("": nothing changed).
    """
    if not compile or num_buckets <= 1:
        return ""
    import torch._dynamo

    config = torch._dynamo.config
    config.automatic_dynamic_shapes = False
    config.recompile_limit = config.recompile_limit * num_buckets
    config.accumulated_recompile_limit = config.accumulated_recompile_limit * num_buckets
    line = (
        f"compile=true on {num_buckets} buckets: one static graph per bucket (automatic dynamic shapes off, "
        f"recompile_limit {config.recompile_limit})"
    )
    log.info(line)
    return line
