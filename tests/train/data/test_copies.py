"""Upsampled samples (train/data/copies.py): each copy of a sample in one epoch gets its own draws, copy 0
keeps the seed every sample always had, and an epoch's (sample, copy) pairs depend on neither the nodes,
ranks and workers nor the point a run resumed at.

`tiny_dataset`: 64 rows in 8 shards of <= 60 kB; `tiny_dataset_b`: 32 rows. An epoch's ids are read
straight from Streaming's `generate_work` for any `World`: the arrangement `__iter__` hands each worker.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.contract import LATENT_MEAN, TEXT_EMBEDDING
from tests.train.conftest import single_threaded_torch, stream_overrides, tiny_config
from train.config import DataConfig
from train.data.copies import split_copy
from train.data.draws import SAMPLE_SEED, sample_seed
from train.data.loader import build_dataloader, build_dataset, pin_version, read_dataset_manifest
from train.data.packing import unpack

SEED = 5
BATCH = 8  # the global batch of every layout below
ONE_DATASET = {"num_workers": 0, "num_canonical_nodes": 2}


def one_dataset_config(root: str, cache: Path, **data: Any) -> tuple[DataConfig, Any]:
    cfg = DataConfig(uri=root, resolution=64, cache_dir=str(cache), **{**ONE_DATASET, **data})
    return cfg, pin_version(cfg, read_dataset_manifest(cfg))


def mix_dataset(a: str, b: str, save: Path, weights: tuple[str, str], **data: Any) -> Any:
    from train.data.mix import streams_to_streaming
    from train.loop.prepare import prepare_data

    cfg = tiny_config(
        "", save, save.parent / f"cache-{save.name}", "samples.enabled=false",
        *stream_overrides(f"{{uri: {a}, name: a, {weights[0]}}}", f"{{uri: {b}, name: b, {weights[1]}}}",
                          num_canonical_nodes=2, num_workers=0, **data),
    )  # fmt: skip
    _, pinned, streams = prepare_data(cfg)
    return build_dataset(cfg.data, pinned, BATCH, SEED, streams=streams_to_streaming(streams, 60))


def epoch_ids(dataset: Any, nodes: int = 1, ranks: int = 1, workers: int = 1, **where: int) -> np.ndarray:
    """The ids of one epoch for a layout (`epoch`, `sample_in_epoch`): Streaming's (nodes, ranks, workers,
    batches, batch) array; flattened, the order one rank with one worker reads them in."""
    from streaming.base.batching import generate_work
    from streaming.base.world import World

    per_rank, dataset.batch_size = dataset.batch_size, BATCH // (nodes * ranks)
    try:
        world = World(nodes, ranks, workers, 0)
        dataset._set_shuffle_block_size(world)  # what `__iter__` sets up before its first epoch
        return generate_work(
            dataset.batching_method, dataset, world, where.get("epoch", 0), where.get("sample_in_epoch", 0)
        )
    finally:
        dataset.batch_size = per_rank


def taken(ids: np.ndarray) -> list[int]:
    return [int(i) for i in ids.flatten() if i != -1]


def seed_of(dataset: Any, sample_id: int) -> int:
    return sample_seed(SEED, 0, *split_copy(sample_id, dataset.num_samples))


def old_sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed before copies had seeds of their own (every run trained so far drew from it)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# ------------------------------------------------------------------------------------------ one dataset
@pytest.fixture(scope="module")
def stored(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each row of `tiny_dataset` as stored, read by index with no upsampling and no cache limit."""
    cfg, pinned = one_dataset_config(tiny_dataset, tmp_path_factory.mktemp("stored"))
    dataset = build_dataset(cfg, pinned, per_rank_batch=4, seed=SEED)
    return [dataset.get_item(i) for i in range(64)]


def check_epoch_of_copies(rows: list[dict[str, Any]], ids: list[int], stored: list[Any], epoch: int) -> None:
    """One epoch of `tiny_dataset` upsampled 2x: `rows` are the epoch's `ids` in order, every sample twice,
    copy 0 with the seed it always had, copy 1 with another, both with the sample's stored columns."""
    seeds = torch.cat([torch.as_tensor(r[SAMPLE_SEED]).view(-1) for r in rows]).tolist()
    latents = torch.cat([r[LATENT_MEAN].view(-1, *stored[0][LATENT_MEAN].shape) for r in rows])
    texts = torch.cat([r[TEXT_EMBEDDING].view(-1, *stored[0][TEXT_EMBEDDING].shape) for r in rows])
    pairs = [split_copy(i, 64) for i in ids]
    assert len(seeds) == len(ids) == 128
    assert Counter(pairs) == Counter((index, copy) for index in range(64) for copy in (0, 1))
    assert seeds == [sample_seed(SEED, epoch, index, copy) for index, copy in pairs]
    assert len(set(seeds)) == 128  # no two copies share their draws
    for (index, copy), seed in zip(pairs, seeds, strict=True):
        if copy == 0:
            assert seed == old_sample_seed(SEED, epoch, index)
    for (index, _), latent, text in zip(pairs, latents, texts, strict=True):
        assert torch.equal(latent, stored[index][LATENT_MEAN])
        assert torch.equal(text, stored[index][TEXT_EMBEDDING])


def test_each_copy_of_an_upsampled_sample_gets_its_own_seed(
    tiny_dataset: str, stored: list[dict[str, Any]], tmp_path: Path
) -> None:
    """epoch_size = 2x the data, two epochs through train's loader, every shard fetched into the cache by
    Streaming's download threads as the copies' ids ask for them."""
    cfg, pinned = one_dataset_config(tiny_dataset, tmp_path, epoch_size=128)
    with single_threaded_torch():
        loader = build_dataloader(cfg, pinned, BATCH, SEED)
        for epoch in (0, 1):
            rows = [unpack(b) for b in loader]
            check_epoch_of_copies(rows, taken(epoch_ids(loader.dataset, epoch=epoch)), stored, epoch)
        del loader
    assert len(list(Path(pinned.local).rglob("*.mds"))) == 8


def test_copies_read_through_a_cache_that_evicts_shards(
    tiny_dataset: str, stored: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A cache of 4 of the 8 shards (<= 60 kB each): reading the 2x epoch evicts shards and fetches them
    again for later copies. Read by id in this thread: Streaming 0.13's ready thread waits forever on a
    shard evicted after it asked for it (a cache this tight under a loaded CPU hung the loader)."""
    cfg, pinned = one_dataset_config(tiny_dataset, tmp_path, epoch_size=128, cache_limit="260kb")
    dataset = build_dataset(cfg, pinned, per_rank_batch=BATCH, seed=SEED)
    stream = dataset.streams[0]
    fetched = []
    fetch = stream.prepare_shard
    stream.prepare_shard = lambda shard: fetched.append(shard) or fetch(shard)
    ids = taken(epoch_ids(dataset))
    check_epoch_of_copies([dataset[i] for i in ids], ids, stored, 0)
    assert len(fetched) > 8  # some shard came back after its eviction
    assert len(list(Path(pinned.local).rglob("*.mds"))) < 8
    assert dataset.cache_usage <= 260 * 1024


@pytest.mark.parametrize("epoch_size", [None, 40])
def test_without_upsampling_every_seed_is_the_one_it_always_was(
    tiny_dataset: str, tmp_path: Path, epoch_size: int | None
) -> None:
    """The whole data, or a 40-sample subset of it, each epoch: no id changes and no seed changes."""
    from streaming import StreamingDataset

    cfg, pinned = one_dataset_config(tiny_dataset, tmp_path, epoch_size=epoch_size, shuffle=True)
    dataset = build_dataset(cfg, pinned, per_rank_batch=4, seed=SEED)
    _, plain = StreamingDataset.resample_streams(dataset, 0)
    assert np.array_equal(dataset.resample_streams(0)[1], plain)
    seeds = [int(row[SAMPLE_SEED]) for row in dataset]
    assert len(seeds) == len(set(seeds)) == (epoch_size or 64)
    assert set(seeds) == {old_sample_seed(SEED, 0, int(i)) for i in plain}
    assert sample_seed(SEED, 3, 7) == sample_seed(SEED, 3, 7, 0) == old_sample_seed(SEED, 3, 7)


# ---------------------------------------------------------------------------------------------- mixes
def occurrence_rank(ids: np.ndarray) -> np.ndarray:
    """The definition of a copy number: how many times the id came earlier in Streaming's epoch list."""
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    start = np.r_[True, ordered[1:] != ordered[:-1]]
    position = np.arange(len(ids))
    rank = np.empty(len(ids), dtype=np.int64)
    rank[order] = position - np.maximum.accumulate(np.where(start, position, 0))
    return rank


def test_copy_numbers_are_each_samples_occurrences_in_streamings_epoch_list(
    tiny_dataset: str, tiny_dataset_b: str, tmp_path: Path
) -> None:
    """repeat 2.5 and choose 50 of 32 (whole and partial passes over shards): the fast per-shard-unit copy
    numbers equal the occurrence count in the list Streaming builds, for the whole epoch and per stream."""
    from streaming import StreamingDataset

    dataset = mix_dataset(tiny_dataset, tiny_dataset_b, tmp_path / "save", ("repeat: 2.5", "choose: 50"))
    n = dataset.num_samples
    assert n == 96 and dataset.epoch_size == 160 + 50
    for epoch in range(3):
        for stream in (None, 0, 1):
            _, plain = StreamingDataset.resample_streams(dataset, epoch, stream)
            _, encoded = dataset.resample_streams(epoch, stream)
            assert np.array_equal(encoded, plain + occurrence_rank(plain) * n)
            assert len(set(encoded.tolist())) == len(encoded)
            copies = Counter(split_copy(i, n)[1] for i in encoded.tolist())
            assert copies[1] > 0 and max(copies) == (1 if stream == 1 else 2)  # 2.5x: copies 0-2


# The layouts of a global batch of 8: (nodes, ranks per node, workers per rank).
LAYOUTS = [(1, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1)]


@pytest.mark.parametrize("method", ["random", "stratified", "per_stream", "device_per_stream"])
def test_an_epochs_copies_do_not_depend_on_the_layout_or_the_resume_point(
    tiny_dataset: str, tiny_dataset_b: str, tmp_path: Path, method: str
) -> None:
    """A 0.75 / 0.25 mix of 128 samples: stream a (64 rows) gives 96, so 32 of its samples twice. On every
    layout the epoch holds the same (sample, copy) pairs, each once; a resume at sample 48 (6 global
    batches), on 1 rank or 2, reads exactly the pairs the 1-rank epoch had left."""
    dataset = mix_dataset(
        tiny_dataset, tiny_dataset_b, tmp_path / "save", ("proportion: 0.75", "proportion: 0.25"),
        batching_method=method, epoch_size=128,
    )  # fmt: skip
    n = dataset.num_samples
    whole = taken(epoch_ids(dataset))
    assert len(whole) == len(set(whole)) == 128
    pairs = [split_copy(i, n) for i in whole]
    assert Counter(copy for index, copy in pairs if index < 64) == {0: 64, 1: 32}
    assert Counter(copy for index, copy in pairs if index >= 64) == {0: 32}
    for layout in LAYOUTS[1:]:
        assert Counter(taken(epoch_ids(dataset, *layout))) == Counter(whole), layout
    # Resumed on 2 nodes of 1 rank each: device_per_stream fills each device batch from one stream, so with
    # 2 ranks on a node its device batches of 4 come in another order than 1 rank's batches of 8
    # (Streaming's own order, copies or not); every method keeps the order over nodes.
    for layout in (LAYOUTS[0], LAYOUTS[2]):
        resumed = taken(epoch_ids(dataset, *layout, sample_in_epoch=48))
        assert Counter(resumed) == Counter(whole[48:]), layout
    assert len({seed_of(dataset, i) for i in whole}) == 128  # every copy its own draws


def test_worker_processes_read_the_same_copies(tiny_dataset: str, tmp_path: Path) -> None:
    """The loader with 2 worker processes (each its own slice of the epoch, ids read through the copy-aware
    spanner in each process) hands out the same (seed, latent) rows as without workers."""

    def rows(workers: int, cache: Path) -> Counter:
        data, where = one_dataset_config(tiny_dataset, cache, epoch_size=96, num_workers=workers)
        with single_threaded_torch():
            loader = build_dataloader(data, where, BATCH, SEED)
            batches = [unpack(b) for b in loader]
            del loader
        return Counter(
            (seed, latent.numpy().tobytes())
            for b in batches
            for seed, latent in zip(b[SAMPLE_SEED].tolist(), b[LATENT_MEAN], strict=True)
        )

    alone, with_workers = rows(0, tmp_path / "a"), rows(2, tmp_path / "b")
    assert sum(alone.values()) == 96 and max(alone.values()) == 1
    assert with_workers == alone
