"""One buffer per batch (train/data/packing.py): columns round-trip exactly, views are aligned and zero-copy,
microbatches split like the unpacked columns, and Streaming counts samples, not bytes; a loader worker's error
is raised as the worker raised it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shared.contract import LATENT_MEAN
from shared.storage.errors import StorageOutageError
from train.data.packing import (
    ALIGN,
    LAYOUT,
    PACKED,
    collate_packed,
    num_samples,
    split_packed,
    unpack,
    with_worker_errors_rebuilt,
)
from train.data.streaming_host import DataError


def rows(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        {
            LATENT_MEAN: torch.randn(4, 3, 3, generator=gen).half(),  # odd byte sizes: alignment matters
            "text_tokens": torch.randint(0, 50000, (7,), generator=gen).to(torch.uint16),
            "sample_seed": torch.tensor(1000 + i, dtype=torch.int64),  # 0-d per row
            "coin": torch.rand((), generator=gen),
            "flag": torch.tensor(i % 2 == 0),
        }
        for i in range(n)
    ]


def test_a_packed_batch_unpacks_to_the_default_collate_exactly() -> None:
    batch = collate_packed(rows(5))
    assert set(batch) == {PACKED, LAYOUT} and batch[PACKED].dtype == torch.uint8
    expected = torch.utils.data.default_collate(rows(5))
    columns = unpack(batch)
    assert list(columns) == list(expected)
    for name, tensor in expected.items():
        assert columns[name].dtype == tensor.dtype and torch.equal(columns[name], tensor), name
        assert columns[name].data_ptr() % ALIGN == batch[PACKED].data_ptr() % ALIGN  # aligned view, no copy
        assert columns[name].untyped_storage().data_ptr() == batch[PACKED].untyped_storage().data_ptr()
    assert num_samples(batch) == 5 == num_samples(columns)


def test_microbatches_are_packed_slices_of_the_batch() -> None:
    batch = collate_packed(rows(5))
    assert split_packed(batch, 8) == [batch] and split_packed(batch, 5) == [batch]
    parts = split_packed(batch, 2)
    assert [num_samples(p) for p in parts] == [2, 2, 1]
    whole = unpack(batch)
    for name, tensor in whole.items():
        assert torch.equal(torch.cat([unpack(p)[name] for p in parts]), tensor), name


def test_streaming_counts_a_packed_batch_in_samples() -> None:
    from train.data.packing import packed_loader_class

    loader = packed_loader_class().__new__(packed_loader_class())
    loader._iterator = None  # what __init__ would set; its __del__ reads it
    assert loader._get_batch_size(collate_packed(rows(3))) == 3


def test_microbatches_of_a_pinned_batch_are_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22 (5): repacked microbatches keep the loader's pinning, so each copy to the GPU stays
    asynchronous. No CUDA here: the pinned allocation is recorded instead of made (the gpu test below
    makes it)."""
    batch = collate_packed(rows(5))
    assert not any(p[PACKED].is_pinned() for p in split_packed(batch, 2))  # unpinned in, unpinned out
    asked: list[bool] = []
    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        asked.append(pin_memory)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    monkeypatch.setattr(torch, "empty", empty)
    parts = split_packed(batch, 2)
    assert asked == [True, True, True] and [num_samples(p) for p in parts] == [2, 2, 1]


@pytest.mark.gpu
def test_microbatches_of_a_pinned_batch_are_pinned_on_a_gpu_machine() -> None:
    batch = collate_packed(rows(5))
    batch[PACKED] = batch[PACKED].pin_memory()  # as the loader hands it over (pin_memory=True on CUDA)
    parts = split_packed(batch, 2)
    assert all(p[PACKED].is_pinned() for p in parts)


class FailingInAWorker(torch.utils.data.IterableDataset):
    def __init__(self, error: Exception):
        self.error = error

    def __iter__(self) -> Any:
        yield torch.zeros(1)
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        PermissionError(13, "Permission denied", "/cache dir/shard.00000.mds"),
        StorageOutageError("downloading shard.00000.mds: S3 did not answer for 90 s: an outage"),
        DataError("a message\nover two lines"),
    ],
    ids=["os-error", "outage", "data-error"],
)
def test_a_loader_workers_error_is_raised_as_the_worker_raised_it(error: Exception) -> None:
    """torch raises it in this process as its type built from the worker's traceback as text: a message the
    CLI printed as its one line, an OSError without its errno, an outage without `transient`."""
    loader = torch.utils.data.DataLoader(FailingInAWorker(error), batch_size=None, num_workers=1)
    batches = with_worker_errors_rebuilt(iter(loader))
    assert next(batches).shape == (1,)
    with pytest.raises(type(error)) as raised:
        next(batches)
    assert str(raised.value) == str(error) and "Traceback" in str(raised.value.__cause__)
    assert getattr(raised.value, "errno", None) == getattr(error, "errno", None)
    assert getattr(raised.value, "filename", None) == getattr(error, "filename", None)
    assert getattr(raised.value, "transient", None) == getattr(error, "transient", None)
