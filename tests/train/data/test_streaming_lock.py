"""Many StreamingDatasets built at the same instant on one host: none may collide on a shm prefix.

Streaming picks its shared-memory prefix by check-then-create (upstream mosaicml/streaming #884, #901);
train/data/loader.py holds a per-user inter-process lock over that step. The children come from a forkserver
that imported torch + streaming once (~10 s, instead of once per child), and are released together by a
barrier; not from a plain fork of pytest, whose threads (left by earlier tests) can hold locks a forked child
then waits on forever. Each joins its own one-rank gloo group, as every rank of a torchrun job has one:
Streaming then meets its ranks in barriers between picking the prefix and creating it, so nothing can retry
its way around a collision.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest

from train.config import DataConfig
from train.data.loader import PinnedData, build_dataset, pin_version, read_dataset_manifest
from train.data.streaming_host import read_shm

PROCESSES = 8
JOIN_TIMEOUT_S = 60.0
MAX_PREFIXES_SCANNED = 4096


def _build_in_child(pinned: PinnedData, store: str, barrier: Any, results: Any) -> None:
    import torch.distributed as torch_dist

    atexit._clear()  # exit handlers inherited from the forkserver are not ours to run
    try:
        torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        barrier.wait(timeout=JOIN_TIMEOUT_S)
        dataset = build_dataset(DataConfig(shuffle=False, num_workers=0), pinned, per_rank_batch=4, seed=0)
        results.put((pinned.local, "ok", len(dataset)))
    except BaseException as err:  # report every failure to the parent, which asserts on it
        results.put((pinned.local, "error", repr(err)))
    finally:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        atexit._run_exitfuncs()  # Streaming unlinks its shared memory in atexit handlers


def registrations_of(local: str) -> list[str]:
    """Streaming shared-memory LOCALS blocks that still name `local` (left behind by a process)."""
    from streaming.base.constant import LOCALS
    from streaming.base.shared.prefix import _get_path, _unpack_locals

    found = []
    for prefix in range(MAX_PREFIXES_SCANNED):
        name = _get_path(prefix, LOCALS)
        registered = read_shm(name)  # not SharedMemory: attaching would make this process unlink it at exit
        if registered is None:
            continue
        their_locals, _ = _unpack_locals(registered)
        if os.path.abspath(local) in (os.path.abspath(p) for p in their_locals):
            found.append(name)
    return found


@pytest.mark.dist
def test_datasets_built_at_the_same_instant_do_not_collide(tiny_dataset: str, tmp_path: Path) -> None:
    pinned = []
    for i in range(PROCESSES):
        cfg = DataConfig(uri=tiny_dataset, resolution=64, cache_dir=str(tmp_path / f"c{i}"), num_workers=0)
        pinned.append(pin_version(cfg, read_dataset_manifest(cfg)))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["train.data.loader", "torch.distributed"])
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    children = [
        ctx.Process(target=_build_in_child, args=(p, str(tmp_path / f"store{i}"), barrier, results))
        for i, p in enumerate(pinned)
    ]
    try:
        for child in children:
            child.start()
        outcomes = [results.get(timeout=JOIN_TIMEOUT_S) for _ in children]
        for child in children:
            child.join(JOIN_TIMEOUT_S)
    finally:
        for child in children:
            if child.is_alive():  # a hung child must not outlive the test
                child.kill()
                child.join()
    failures = [o for o in outcomes if o[1] != "ok"]
    assert not failures, failures
    assert sorted(o[2] for o in outcomes) == [64] * PROCESSES
    assert [child.exitcode for child in children] == [0] * PROCESSES
    left = {p.local: registrations_of(p.local) for p in pinned}
    assert not any(left.values()), f"shared memory left behind: {left}"
