"""Which copy of a sample an epoch's id names, so that each copy of an upsampled sample gets its own draws.

Streaming yields a sample several times in one epoch when a stream is upsampled (`repeat` > 1, `choose` or
a proportion larger than the stream, `epoch_size` larger than the data). Every draw of a sample is seeded by
(seed, epoch, sample index) (train/data/draws.py `sample_seed`), so each copy would be the identical
(noised latent, timestep, caption dropout) example: upsampling added weight but no new noise.

Streaming builds each epoch's sample list once, before any partitioning, in `resample_streams` (streaming
0.13 base/dataset.py): per shard, `shard_choose // shard_samples` full passes over the shard's ids, then a
sorted partial pass without replacement, each pass one "shuffle unit", a shard's units next to each other;
seeded by (shuffle_seed, epoch) alone. Copy k of a sample is its k-th occurrence in that list, the k-th
unit of its shard: a function of the epoch, not of nodes, ranks, workers or the resume point. Every batching
method (random, stratified, per_stream, device_per_stream in streaming/base/batching/) calls
`resample_streams` and only indexes its list (`small_per_big[big_ids]`, -1 for padding), so the copy rides
in the id: copy k >= 1 of sample s becomes `s + k * num_samples`. Copy 0 keeps its plain id (every sample
of data without upsampling, so no existing run's draws change). Streaming maps an id to its shard through
`self.spanner` only (`get_item`, and the download and ready threads of `__iter__`), so `CopySpanner` reads
the sample under any copy and the shard download and cache eviction see plain shard ids.

Streaming's own padding (`partition/orig.py` repeating a few positions so that ranks and workers get equal
shares) repeats an id as it is: those repeats are the layout's, not the epoch's, and keep their draws.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray


def copy_per_unit(
    units: NDArray[np.int64], ids: NDArray[np.int64], shard_offsets: NDArray[np.int64]
) -> NDArray[np.int64]:
    """Per shuffle unit of `resample_streams`' (units, ids): its index among its shard's units, i.e. which
    copy of the shard's samples it holds. O(units): a shard's units are adjacent, and a unit's first id
    names its shard (`shard_offsets`: each shard's first global sample id)."""
    starts = np.cumsum(units) - units
    shard = np.searchsorted(shard_offsets, ids[starts], side="right") - 1
    position = np.arange(len(units))
    first = np.ones(len(units), dtype=bool)
    first[1:] = shard[1:] != shard[:-1]
    return position - np.maximum.accumulate(np.where(first, position, 0))


def encode_copies(
    units: NDArray[np.int64], ids: NDArray[np.int64], shard_offsets: NDArray[np.int64], num_samples: int
) -> NDArray[np.int64]:
    """`ids` with copy k >= 1 of sample s written as `s + k * num_samples`; unchanged (the same array) when
    no shard is upsampled, at O(units) cost."""
    if int(units.sum()) != len(ids):
        raise RuntimeError(
            f"Streaming's resample_streams gave {len(ids)} ids for shuffle units of {int(units.sum())} "
            "samples: train/data/copies.py reads its layout of streaming 0.13; check it against this version"
        )
    copies = copy_per_unit(units, ids, shard_offsets)
    if not copies.any():
        return ids
    return ids + np.repeat(copies, units) * num_samples


def split_copy(sample_id: int, num_samples: int) -> tuple[int, int]:
    """(sample index, copy) of an id `encode_copies` wrote; an id below `num_samples` is copy 0 of itself."""
    copy, index = divmod(int(sample_id), num_samples)
    return index, copy


class CopySpanner:
    """Streaming's `Spanner` (global sample id -> (shard, index in shard)) for ids that carry a copy."""

    def __init__(self, spanner: Any) -> None:
        self.spanner = spanner
        self.num_samples = int(spanner.num_samples)

    def __getitem__(self, sample_id: int) -> tuple[int, int]:
        return self.spanner[split_copy(sample_id, self.num_samples)[0]]


class DistinctCopies:
    """StreamingDataset mixin (list it before StreamingDataset): epochs whose ids carry their copy, read as
    the plain samples; `copy_of(id)` gives (sample index, copy) for the sample's seed."""

    num_samples: int
    sample_offset_per_shard: NDArray[np.int64]
    spanner: Any

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spanner = CopySpanner(self.spanner)

    def resample_streams(self, epoch: int, stream_id: int | None = None) -> tuple[Any, Any]:
        units, ids = super().resample_streams(epoch, stream_id)  # type: ignore[misc]
        return units, encode_copies(units, ids, self.sample_offset_per_shard, self.num_samples)

    def copy_of(self, sample_id: int) -> tuple[int, int]:
        return split_copy(sample_id, self.num_samples)
