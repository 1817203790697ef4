"""The held-out rows: the first `eval.num_samples` samples of an encoded dataset, in stored order.

Read straight from the version's MDS shards (no StreamingDataset: no shared memory, no shuffling, no
barrier), each shard that holds one of them once, into memory, checked against its index hash when it
records one. A rank keeps only the rows it evaluates. The version's index is placed under
`<cache root>/eval/...`, a folder of its own, never one a training StreamingDataset uses.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared import storage
from shared.contract import SHARD_HASH, TRAIN_COLUMNS, ContractError, Expectation, check_compatible
from shared.manifest import DatasetManifest, Layout
from shared.presets import get_preset
from train.config import DataConfig, EvalConfig
from train.data.loader import (
    PinnedData,
    cache_dir_for,
    default_cache_root,
    place_index,
    read_dataset_manifest,
)
from train.data.mix import encoder_facts
from train.data.streaming_host import DataError

EVAL_CACHE = "eval"  # below the data cache root: the eval dataset's own folder


@dataclass
class EvalRows:
    """The rows one rank evaluates: their sample indices (in the dataset's stored order) and columns."""

    indices: list[int]
    columns: dict[str, torch.Tensor]  # TRAIN_COLUMNS present in the dataset, [len(indices), ...]
    pinned: PinnedData
    # A rank with no sample of its own (more ranks than samples) holds sample 0 only to run the same
    # forwards as the others (an FSDP forward is collective); its pairs weigh nothing.
    padding: bool = False


def pin_eval_data(
    cfg: EvalConfig,
    preset: str,
    resolution: int,
    cache_dir: str,
    trained_with: dict[str, Any],
    size: str = "",
) -> PinnedData:
    """The eval dataset's version, its contract checked against the model's preset and resolution, and its
    encoders against the training data's (`trained_with`: train/data/mix.py encoder_facts).

    `size` ("HxW" px): the bucket of a bucketed eval dataset to evaluate on; "": its square bucket.
    """
    root = os.path.join(cache_dir or default_cache_root(), EVAL_CACHE)
    data_cfg = DataConfig(uri=cfg.uri, resolution=resolution, version=cfg.version, cache_dir=root)
    manifest = read_dataset_manifest(data_cfg)
    p = get_preset(preset)
    check_compatible(manifest, Expectation(resolution, p.latent_shape(resolution), p.text_shape()))
    check_eval_encoders(cfg.uri, manifest, trained_with)
    pinned = place_version_index(data_cfg, manifest, size)
    if pinned.num_samples < cfg.num_samples:
        where = f"{pinned.bucket} px (bucket of {resolution} px)" if pinned.bucket else f"{resolution} px"
        raise DataError(
            f"eval.num_samples={cfg.num_samples} but the eval dataset {cfg.uri} has {pinned.num_samples} "
            f"samples at {where}; lower eval.num_samples or encode more held-out data"
        )
    return pinned


def check_eval_encoders(uri: str, manifest: DatasetManifest, trained_with: dict[str, Any]) -> None:
    """Held-out latents from another VAE (or text from another tower) score the model on inputs it never
    learned: the loss would be a number about nothing. The text store mode may differ (tokens are embedded
    by the run's own tower)."""
    have = encoder_facts(manifest.identity, float(manifest.scale_factor))
    for key, want in trained_with.items():
        if have[key] != want:
            raise ContractError(
                f"eval.uri {uri} was encoded with {key} {have[key]!r} but the training data with {want!r}: "
                "its held-out loss would score latents or text this model never trained on; encode the "
                "held-out set with the training data's encoder config"
            )


def place_version_index(cfg: DataConfig, manifest: DatasetManifest, size: str = "") -> PinnedData:
    """train/data/loader.py's `pin_version` without claiming the cache folder: no StreamingDataset reads
    it, so `train eval` may run beside a training run that evaluates the same dataset. A bucketed dataset
    gives one bucket (`size`, default the square): the held-out loss compares fixed samples of one shape."""
    root, vid = cfg.uri.rstrip("/"), manifest.version
    local = cache_dir_for(cfg.cache_dir, root, vid, cfg.resolution)
    remote = Layout(root).stream_root(cfg.resolution)
    info = manifest.resolutions[cfg.resolution]
    square = f"{cfg.resolution}x{cfg.resolution}"
    if info.buckets is not None:
        bucket = size or square
        if not (info.buckets.get(bucket) or {}).get("num_samples"):
            have = ", ".join(n for n, b in info.buckets.items() if b["num_samples"])
            raise DataError(
                f"the eval dataset {cfg.uri} has no samples in bucket {bucket} at {cfg.resolution} px "
                f"(it has: {have}); pass --size with one of those"
            )
        local = os.path.join(local, bucket)
        index = Layout(root).bucket_index(vid, cfg.resolution, bucket)
        shapes = info.bucket_shapes(cfg.resolution)[bucket]
        summary = place_index(index, local, shapes, info.buckets[bucket]["num_samples"], remote)
        return PinnedData(root, vid, cfg.resolution, manifest, remote, local, summary.hashed, bucket=bucket)
    if size and size != square:
        raise DataError(
            f"--size {size}: the eval dataset {cfg.uri} is square-only at {cfg.resolution} px; encode it "
            "with transform.buckets to evaluate other shapes"
        )
    index = Layout(root).version_index(vid, cfg.resolution)
    summary = place_index(index, local, info.shapes, info.num_samples, remote)
    return PinnedData(root, vid, cfg.resolution, manifest, remote, local, summary.hashed)


def rank_indices(num_samples: int, rank: int, world: int) -> list[int]:
    """A contiguous block of ceil(num_samples / world) samples per rank (the last ones may get fewer or
    none): each rank reads only the shards of its block, not every shard the eval set spans."""
    per_rank = -(-num_samples // world)
    return list(range(rank * per_rank, min(num_samples, (rank + 1) * per_rank)))


def rows_for_rank(pinned: PinnedData, num_samples: int, rank: int, world: int) -> EvalRows:
    indices = rank_indices(num_samples, rank, world)
    if indices:
        return read_rows(pinned, indices)
    rows = read_rows(pinned, [0])
    rows.padding = True
    return rows


def read_rows(pinned: PinnedData, indices: list[int]) -> EvalRows:
    """The stored columns of `indices` (ascending), reading only the shards that hold them."""
    from streaming.base.format import reader_from_json

    from train.data.mds_reader import decode_train_columns_only

    index = json.loads(Path(pinned.local, "index.json").read_text())
    wanted, rows = sorted(indices), []
    start = 0
    for info in index["shards"]:
        count = int(info["samples"])
        inside = [i - start for i in wanted if start <= i < start + count]
        if inside:
            shard = reader_from_json(pinned.local, None, info)
            decode_train_columns_only([shard])
            rows += [shard.decode_sample(data) for data in shard_samples(shard_bytes(pinned, info), inside)]
        start += count
        if start > wanted[-1]:
            break
    names = [name for name in TRAIN_COLUMNS if name in rows[0]]
    columns = {name: torch.stack([torch.from_numpy(row[name].copy()) for row in rows]) for name in names}
    return EvalRows(wanted, columns, pinned)


def shard_bytes(pinned: PinnedData, info: dict[str, Any]) -> bytes:
    """One shard's raw MDS bytes (decompressed; verified against its index hash when it has one)."""
    raw, zipped = info["raw_data"], info.get("zip_data")
    entry = raw
    path = storage.join(pinned.remote, raw["basename"])
    if zipped and not (not storage.is_s3(pinned.remote) and os.path.exists(path)):
        entry, path = zipped, storage.join(pinned.remote, zipped["basename"])
    data = storage.read_bytes(path)
    expected = entry.get("hashes", {}).get(SHARD_HASH)
    if expected:
        from streaming.base.hashing import get_hash

        if get_hash(SHARD_HASH, data) != expected:
            raise DataError(
                f"{path} does not match the {SHARD_HASH} hash its index recorded at encode time; re-run "
                "`make encode` into a fresh output.uri (or restore the file)"
            )
    if entry is zipped:
        from streaming.base.compression import decompress

        data = decompress(info["compression"], data)
    return data


def shard_samples(data: bytes, inside: list[int]) -> list[bytes]:
    """The bytes of samples `inside` of an MDS shard (a count, then count + 1 uint32 offsets)."""
    import numpy as np

    count = int(np.frombuffer(data[:4], "<u4")[0])
    offsets = np.frombuffer(data[4 : 4 + 4 * (count + 1)], "<u4")
    return [data[int(offsets[i]) : int(offsets[i + 1])] for i in inside]


def read_captions(uri: str, count: int) -> list[str]:
    """The captions of an encoded dataset's first `count` samples in stored order (any resolution: every
    resolution holds the same samples' captions in its own order; the lowest is read)."""
    from streaming.base.format import reader_from_json

    from shared.contract import CAPTION

    manifest = read_dataset_manifest(DataConfig(uri=uri))
    resolution = min(manifest.resolutions)
    root = os.path.join(default_cache_root(), EVAL_CACHE)
    pinned = place_version_index(DataConfig(uri=uri, resolution=resolution, cache_dir=root), manifest)
    index = json.loads(Path(pinned.local, "index.json").read_text())
    captions: list[str] = []
    for info in index["shards"]:
        shard = reader_from_json(pinned.local, None, info)
        wanted = list(range(min(int(info["samples"]), count - len(captions))))
        captions += [
            shard.decode_sample(d)[CAPTION] for d in shard_samples(shard_bytes(pinned, info), wanted)
        ]
        if len(captions) >= count:
            break
    return captions
