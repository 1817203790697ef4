"""Data side of `make bench`: a real MDS dataset on disk and train's real loader over it (the Composer
trainer over the same dataset: train/bench/trainer/).

The dataset is written the way encode lays out its output (shared/manifest.py): rows at the preset's exact
shapes through `streaming.MDSWriter` + `shared.contract`, one partition, a merged index per version and a
manifest, so `train.data.loader` and `train.loop.trainer` read it exactly as they read a real encode output.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from shared.buckets import parse_bucket
from shared.contract import SHARD_HASH, Shapes, make_row, mds_columns
from shared.manifest import INDEX_NAME, DatasetManifest, Layout, ResolutionInfo, fingerprint
from shared.presets import Preset
from train.config import DataConfig
from train.data import packing
from train.data.buckets import run_streams
from train.data.loader import build_dataloader, pin_version, read_dataset_manifest

VERSION = "bench"
PARTITION = "part00000-bench"
# Encode's default shard size (encode.config.OutputConfig.shard_size_limit): the loader sees real shards.
SHARD_SIZE_LIMIT = 1 << 27
READ_CHUNK = 1 << 24
LOGVAR_RANGE = (-6.0, -2.0)  # typical stored posterior log-variances; values do not affect speed


# ---------------------------------------------------------------------------------------------- dataset
def write_synthetic_dataset(
    root: Path, preset: Preset, resolution: int, rows: int, seed: int, buckets: list[str] | None = None
) -> DatasetManifest:
    """An encode output at `root` holding `rows` random rows at the preset's shapes for one resolution; with
    `buckets` ("HxW" px), bucketed as encode's transform.buckets lays it out: `rows` in every bucket."""
    shapes = Shapes(preset.latent_shape(resolution), preset.text_shape())
    layout = Layout(str(root))
    part_dir = Path(layout.partition_output(resolution, PARTITION))
    rng = np.random.default_rng(seed)
    if buckets:
        info = _write_buckets(layout, part_dir, shapes, resolution, buckets, rows, rng)
    else:
        size = _write_rows(part_dir, shapes, rows, rng)
        index = _index_below_stream_root(part_dir, part_dir.name)
        for uri in (layout.version_index(VERSION, resolution), layout.current_index(resolution)):
            _write_json(Path(uri), index)
        info = ResolutionInfo(rows, shapes, size, 0, fingerprint([seed, rows, resolution]))
    manifest = DatasetManifest(
        version=VERSION,
        created=datetime.now(UTC).isoformat(),
        preset=preset.name,
        scale_factor=preset.scale_factor,
        resolutions={resolution: info},
        rejected={},
        samples_read=info.num_samples,
        fingerprints={
            "dataset": fingerprint(
                ["bench", preset.name, seed, rows, resolution, *([buckets] if buckets else [])]
            ),
            "encoders": {},
        },
        empty_caption_embedding=np.zeros(shapes.text, dtype=np.float16),
        partitions=[{"id": PARTITION, "dirs": {str(resolution): PARTITION}}],
        config={"preset": preset.name, "encoder": {}},
    )
    for uri in (layout.version_manifest(VERSION), layout.manifest):
        _write_json(Path(uri), manifest.to_json())
    return manifest


def _write_rows(
    out: Path, shapes: Shapes, rows: int, rng: np.random.Generator, bucket: tuple[int, int] | None = None
) -> int:
    """`rows` random rows at `shapes` as MDS shards in `out` (bucketed rows: images of exactly the bucket's
    (H, W) px, uncropped); returns their bytes."""
    from streaming import MDSWriter

    geometry = None if bucket is None else (bucket, (0.0, 0.0, float(bucket[1]), float(bucket[0])))

    # hashed as encode writes its shards: train's loader verifies each on first read, as it will in a run
    columns = mds_columns(shapes)
    with MDSWriter(out=str(out), columns=columns, size_limit=SHARD_SIZE_LIMIT, hashes=[SHARD_HASH]) as writer:
        for i in range(rows):
            mean = rng.standard_normal(shapes.latent, dtype=np.float32)
            logvar = rng.uniform(*LOGVAR_RANGE, shapes.latent)
            text = rng.standard_normal(shapes.text, dtype=np.float32)
            writer.write(make_row(f"{i:09d}", f"bench caption {i}", mean, logvar, text, geometry))
    return sum(p.stat().st_size for p in out.glob("*.mds"))


def _write_buckets(
    layout: Layout,
    part_dir: Path,
    square: Shapes,
    resolution: int,
    buckets: list[str],
    rows: int,
    rng: np.random.Generator,
) -> ResolutionInfo:
    """Per bucket a sub-folder of the partition and one index of that bucket (shared/manifest.py)."""
    counts = {}
    for name in buckets:
        bucket = parse_bucket(name)
        shapes = square.for_bucket(bucket, resolution // square.latent[1])
        size = _write_rows(part_dir / name, shapes, rows, rng, bucket)
        index = _index_below_stream_root(part_dir / name, f"{part_dir.name}/{name}")
        _write_json(Path(layout.bucket_index(VERSION, resolution, name)), index)
        counts[name] = {"num_samples": rows, "bytes": size}
    total = rows * len(buckets)
    size = sum(c["bytes"] for c in counts.values())
    bucketed = dataclasses.replace(square, bucketed=True)
    return ResolutionInfo(total, bucketed, size, 0, fingerprint([rows, resolution, buckets]), buckets=counts)


def _index_below_stream_root(out: Path, prefix: str) -> dict[str, Any]:
    """The MDS index in `out`, shard paths made relative to the stream root (as encode merges them)."""
    index = json.loads((out / INDEX_NAME).read_text())
    for shard in index["shards"]:
        for key in ("raw_data", "zip_data"):
            if shard.get(key):
                shard[key]["basename"] = f"{prefix}/{shard[key]['basename']}"
    return index


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def shard_files(root: Path, resolution: int) -> list[Path]:
    return sorted(Path(Layout(str(root)).stream_root(resolution)).rglob("*.mds"))


# ----------------------------------------------------------------------------------------------- reading
def raw_read_bytes_per_s(files: list[Path], repeats: int) -> tuple[float, int]:
    """(median bytes/s, bytes) of reading the shard files start to end with plain file reads.

    The files were just written, so this mostly measures the page cache: an upper bound for any reader.
    """
    total = sum(p.stat().st_size for p in files)
    seconds = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        for path in files:
            with path.open("rb", buffering=0) as handle:
                while handle.read(READ_CHUNK):
                    pass
        seconds.append(time.perf_counter() - start)
    return total / statistics.median(seconds), total


def data_config(root: Path, resolution: int, cache_dir: Path, num_workers: int) -> Any:
    return DataConfig(
        uri=str(root),
        resolution=resolution,
        cache_dir=str(cache_dir),
        num_workers=num_workers,
        num_canonical_nodes=1,
    )


@dataclass
class LoaderRun:
    """One pass over the dataset: when the first batch arrived, and the samples and seconds after it."""

    first_batch_s: float
    samples_after_first: int
    seconds_after_first: float

    @property
    def images_per_s(self) -> float:
        return self.samples_after_first / max(self.seconds_after_first, 1e-9)


def _one_pass(loader: Any) -> LoaderRun:
    start = time.perf_counter()
    first = last = None
    samples = 0
    for batch in loader:
        last = time.perf_counter()
        if first is None:  # worker start-up and the first shard's copy: reported apart, not in the rate
            first = last
            continue
        samples += packing.num_samples(batch)
    if first is None or last is None:
        raise ValueError("the bench dataset yielded no batch: raise loader.rows above the batch size")
    return LoaderRun(first - start, samples, last - first)


def bench_loader(
    root: Path, resolution: int, batch_size: int, num_workers: int, passes: int, cache_dir: Path, seed: int
) -> dict[str, Any]:
    """Train's real StreamingDataLoader over the dataset (bucketed or not): images/s per pass (pass 1 copies
    shards in)."""
    cfg = data_config(root, resolution, cache_dir, num_workers)
    pinned = pin_version(cfg, read_dataset_manifest(cfg))
    # as the trainer builds it: a bucketed dataset reads one stream per bucket, per_stream batches
    streams, _, method = run_streams(cfg.batching_method, pinned, [], batch_size, cfg.download_timeout)
    loader = build_dataloader(cfg, pinned, batch_size, seed, streams, method)
    runs = [_one_pass(loader) for _ in range(max(passes, 1))]
    del loader
    gc.collect()  # shuts the persistent workers down and releases Streaming's shared memory
    rates = [r.images_per_s for r in runs]
    warm = rates[1:] or rates
    return {
        "images_per_s": statistics.median(warm),
        "images_per_s_by_pass": rates,  # pass 1: cold local cache (shards copied from the "remote" folder)
        "first_batch_s": runs[0].first_batch_s,
        "batch_size": batch_size,
        "num_workers": num_workers,
    }


# ------------------------------------------------------------------------------- against plain Streaming
def _plain_pass(loader: Any) -> LoaderRun:
    """`_one_pass` for batches of plain Streaming rows (dicts of numpy arrays collated by torch)."""
    start = time.perf_counter()
    first = last = None
    samples = 0
    for batch in loader:
        last = time.perf_counter()
        if first is None:
            first = last
            continue
        samples += len(batch["key"])
    if first is None or last is None:
        raise ValueError("the bench dataset yielded no batch: raise loader.rows above the batch size")
    return LoaderRun(first - start, samples, last - first)


def bench_plain_streaming(
    roots: list[Path], resolution: int, batch_size: int, num_workers: int, passes: int, cache_dir: Path
) -> float:
    """Median warm images/s of a bare `StreamingDataset` (+ StreamingDataLoader, default collate) over the
    same shards as `bench_loader`: the fair peer of train's loader, which adds the version pin, the
    per-sample draws and packing on top of it."""
    from streaming import Stream, StreamingDataLoader, StreamingDataset

    from train.data.streaming_host import streaming_prefix_lock

    weight = {"proportion": 1.0} if len(roots) > 1 else {}  # as bench_loader_vs_streaming weights a mix
    streams = [
        Stream(remote=Layout(str(root)).stream_root(resolution), local=str(cache_dir / f"s{i}"), **weight)
        for i, root in enumerate(roots)
    ]
    with streaming_prefix_lock() as created:
        dataset = created(
            StreamingDataset(streams=streams, batch_size=batch_size, shuffle=True, num_canonical_nodes=1)
        )
    extra = {"persistent_workers": True} if num_workers > 0 else {}
    loader = StreamingDataLoader(
        dataset, batch_size=batch_size, num_workers=num_workers, drop_last=True, **extra
    )
    runs = [_plain_pass(loader) for _ in range(max(passes, 1))]
    del loader, dataset
    gc.collect()
    rates = [r.images_per_s for r in runs]
    return statistics.median(rates[1:] or rates)


def bench_loader_vs_streaming(
    roots: list[Path], resolution: int, batch_size: int, num_workers: int, passes: int, work: Path, seed: int
) -> dict[str, Any]:
    """Train's loader over one dataset or a mix of `roots` (data.streams, equal proportions) and plain
    Streaming over the same shards, one after the other in one process (`make bench` reports the ratio)."""
    from train.config import StreamConfig
    from train.data.mix import pin_streams, read_stream_manifests, streams_to_streaming

    cfg = data_config(roots[0], resolution, work / "train-cache", num_workers)
    if len(roots) > 1:
        streams = [StreamConfig(uri=str(r), name=f"s{i}", proportion=1.0) for i, r in enumerate(roots)]
        cfg = dataclasses.replace(cfg, uri="", streams=streams)
        pinned = pin_streams(cfg, read_stream_manifests(cfg))
        loader = build_dataloader(
            cfg, pinned[0].pinned, batch_size, seed, streams=streams_to_streaming(pinned, 120)
        )
    else:
        loader = build_dataloader(cfg, pin_version(cfg, read_dataset_manifest(cfg)), batch_size, seed)
    train_runs = [_one_pass(loader) for _ in range(max(passes, 1))]
    del loader
    gc.collect()
    train_rates = [r.images_per_s for r in train_runs]
    train_rate = statistics.median(train_rates[1:] or train_rates)
    plain = bench_plain_streaming(roots, resolution, batch_size, num_workers, passes, work / "plain-cache")
    return {
        "streams": len(roots),
        "images_per_s": train_rate,
        "plain_streaming_images_per_s": plain,
        "vs_plain_streaming": train_rate / plain,
    }
