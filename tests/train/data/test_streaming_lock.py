"""Many StreamingDatasets built at the same instant on one host: none may collide on a shm prefix.

Streaming picks its shared-memory prefix by check-then-create (upstream mosaicml/streaming #884, #901);
train/data/loader.py holds a per-user inter-process lock over that step. The children come from a forkserver
that imported torch + streaming once (~10 s, instead of once per child), and are released together by a
barrier; not from a plain fork of pytest, whose threads (left by earlier tests) can hold locks a forked child
then waits on forever. Each joins its own one-rank gloo group, as every rank of a torchrun job has one:
Streaming then meets its ranks in barriers between picking the prefix and creating it, so nothing can retry
its way around a collision.

Within one job, the ranks of a node must agree on the prefix although another job's segments come and go
while they build: the second test tears one down between the leader's scan and the other rank's.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from train.config import DataConfig
from train.data import streaming_host
from train.data.loader import PinnedData, build_dataset, pin_version, read_dataset_manifest
from train.data.shm import read_shm

PROCESSES = 8
JOIN_TIMEOUT_S = 60.0
# The parent's wait for all results: the forkserver's imports (seconds alone, a minute and more on a 2-core
# CI box beside a compiling test: one CI run timed out at 60 s) and then the children's own barrier, which
# reports a hung sibling as an error after JOIN_TIMEOUT_S.
RESULTS_TIMEOUT_S = 240.0
MAX_PREFIXES_SCANNED = 4096
# Imported once in the forkserver, not in each child: train.data.loader imports Streaming lazily, and
# Streaming's import (torchvision with it) takes ~3 s of CPU per process.
PRELOAD = ["train.data.loader", "torch.distributed", "streaming"]


@pytest.fixture(scope="module", autouse=True)
def forkserver_stopped_at_the_end() -> Iterator[None]:
    """The forkserver these tests start imports torch, which makes a temp folder at import and removes it when
    the server exits: on its own that is when pytest's process ends, after the session checked its temp
    folder for leftovers (tests/leftovers.py), so it was reported as one. Stopped here, it is gone first."""
    yield
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's, for its own tests
    if stop is not None:
        stop()


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


def why_waiting(children: list[Any]) -> str:
    """What children that sent no result are doing (their stacks, from outside) and who holds the host's
    prefix lock they queue on: a CI run once timed out here with nothing else to go on."""
    from shared.launch.ranks import stack_of

    lines = []
    lock = streaming_host.prefix_lock_path()
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            lines.append(f"{lock} held by: {streaming_host.lock_holders(fd)}")
        finally:
            os.close(fd)
    for child in children:
        if child.is_alive():
            lines.append(f"child {child.pid}:\n{stack_of(child.pid)}")
    return "\n".join(lines)


@pytest.mark.dist
def test_datasets_built_at_the_same_instant_do_not_collide(tiny_dataset: str, tmp_path: Path) -> None:
    pinned = []
    for i in range(PROCESSES):
        cfg = DataConfig(uri=tiny_dataset, resolution=64, cache_dir=str(tmp_path / f"c{i}"), num_workers=0)
        pinned.append(pin_version(cfg, read_dataset_manifest(cfg)))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    children = [
        ctx.Process(target=_build_in_child, args=(p, str(tmp_path / f"store{i}"), barrier, results))
        for i, p in enumerate(pinned)
    ]
    try:
        for child in children:
            child.start()
        deadline = time.monotonic() + RESULTS_TIMEOUT_S
        try:
            outcomes = [results.get(timeout=max(1.0, deadline - time.monotonic())) for _ in children]
        except queue.Empty:
            pytest.fail(f"no result from every child in {RESULTS_TIMEOUT_S:.0f} s:\n{why_waiting(children)}")
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


def _create_foreign_locals(name: str, folder: str) -> None:
    """Another job's registration: a Streaming LOCALS block `name` naming `folder`."""
    import _posixshmem

    from streaming.base.shared.prefix import _pack_locals

    data = _pack_locals([folder], 0)
    fd = _posixshmem.shm_open(f"/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, len(data))
        with mmap.mmap(fd, len(data)) as view:
            view[:] = data
    finally:
        os.close(fd)


def _rank_in_child(pinned: PinnedData, store: str, rank: int, gone: str, other: str, results: Any) -> None:
    """One of two ranks on one node. Rank 0 (the leader) finds another job's prefix registered where its
    scan would land, and that job tears it down once the leader has scanned; rank 1 scans (if it scans at
    all) only after that, as a rank that reaches the scan later does."""
    atexit._clear()  # first: what the imports below register at exit is ours to run
    import _posixshmem

    import torch.distributed as torch_dist
    from streaming.base.constant import LOCALS
    from streaming.base.shared.prefix import _get_path

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    scan, foreign = streaming_host.first_free_prefix, []

    def leader_scan(streams_local: list[str], streams_remote: list[Any], retry: int) -> int:
        if not foreign:
            foreign.append(_get_path(scan(streams_local, streams_remote, retry), LOCALS))
            _create_foreign_locals(foreign[0], other)
        found = scan(streams_local, streams_remote, retry)
        if not Path(gone).exists():  # the leader's scan is over: the other job exits
            _posixshmem.shm_unlink(f"/{foreign[0]}")
            Path(gone).touch()
        return found

    def late_scan(*args: Any, **kwargs: Any) -> int:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not Path(gone).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return scan(*args, **kwargs)

    streaming_host.first_free_prefix = leader_scan if rank == 0 else late_scan
    try:
        torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        dataset = build_dataset(DataConfig(shuffle=False, num_workers=0), pinned, per_rank_batch=4, seed=0)
        results.put((rank, "ok", dataset._shm_prefix_int, foreign[:1]))
        torch_dist.barrier()  # the leader's segments stay until rank 1 has attached
    except BaseException as err:  # report every failure to the parent, which asserts on it
        results.put((rank, "error", repr(err), foreign[:1]))
    finally:
        if foreign and not Path(gone).exists():  # the leader failed before its scan ended
            _posixshmem.shm_unlink(f"/{foreign[0]}")
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        atexit._run_exitfuncs()


@pytest.mark.dist
def test_the_ranks_of_a_node_agree_on_the_prefix_when_another_job_exits_between_their_scans(
    tiny_dataset: str, tmp_path: Path
) -> None:
    cfg = DataConfig(uri=tiny_dataset, resolution=64, cache_dir=str(tmp_path / "cache"), num_workers=0)
    pinned = pin_version(cfg, read_dataset_manifest(cfg))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    args = (pinned, str(tmp_path / "store"))
    extra = (str(tmp_path / "gone"), str(tmp_path / "another-job"), results)
    children = [ctx.Process(target=_rank_in_child, args=(*args, rank, *extra)) for rank in range(2)]
    try:
        for child in children:
            child.start()
        deadline = time.monotonic() + RESULTS_TIMEOUT_S
        outcomes = sorted(results.get(timeout=max(1.0, deadline - time.monotonic())) for _ in children)
        for child in children:
            child.join(JOIN_TIMEOUT_S)
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
                child.join()
    assert [o[1] for o in outcomes] == ["ok", "ok"], outcomes
    (_, _, leader_prefix, foreign), (_, _, other_prefix, _) = outcomes
    assert foreign, "the leader's scan never met the other job's registration"
    from streaming.base.constant import LOCALS
    from streaming.base.shared.prefix import _get_path

    assert _get_path(leader_prefix, LOCALS) != foreign[0]  # the leader saw the other job's prefix taken
    assert other_prefix == leader_prefix
    assert [child.exitcode for child in children] == [0, 0]
    assert not registrations_of(pinned.local)


def test_a_prefix_registered_between_the_scan_and_the_create_is_scanned_past(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another job (here: the test, as one with another TMPDIR, whose prefix lock this process never sees)
    registers the prefix this process's scan found, before this process creates it: FileExistsError
    '/0000NN_locals' stopped the run as a fatal path error; now it scans again."""
    from streaming.base.constant import LOCALS
    from streaming.base.shared.prefix import _get_path

    from train.data.streaming_host import register_free_prefix

    scan, stolen = streaming_host.first_free_prefix, []

    def racing_scan(streams_local: list[str], streams_remote: list[Any], retry: int) -> int:
        found = scan(streams_local, streams_remote, retry)
        if not stolen:  # the scan is over: the other job registers the prefix it found
            stolen.append(_get_path(found, LOCALS))
            _create_foreign_locals(stolen[0], str(tmp_path / "another-job"))
        return found

    monkeypatch.setattr(streaming_host, "first_free_prefix", racing_scan)
    shm = None
    try:
        prefix, shm = register_free_prefix([str(tmp_path / "mine")], [None], retry=1)
        assert stolen and _get_path(prefix, LOCALS) != stolen[0]
        assert read_shm(stolen[0]) is not None  # the other job's registration is left alone
        assert registrations_of(str(tmp_path / "mine")) == [_get_path(prefix, LOCALS)]
    finally:
        import _posixshmem

        if shm is not None:
            shm.cleanup()
        for name in stolen:
            _posixshmem.shm_unlink(f"/{name}")
    assert not registrations_of(str(tmp_path / "mine"))


def shm_descriptors() -> set[str]:
    """What this process holds open in /dev/shm."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/dev/shm/"):
                held.add(target)
    return held


def test_the_prefix_scan_holds_no_descriptor_of_the_segments_it_passes(tmp_path: Path) -> None:
    """Streaming's own scan attached every live segment it passed, for good: a process that built datasets
    one after another held a quadratic number of descriptors (4,700 in the bench's data section)."""
    import _posixshmem

    from streaming.base.constant import LOCALS
    from streaming.base.shared.prefix import _get_path

    from train.data.streaming_host import first_free_prefix

    mine = [str(tmp_path / "mine")]
    taken: list[str] = []
    try:
        for i in range(4):  # other jobs' registrations, at the prefixes this scan would have taken
            taken.append(_get_path(first_free_prefix(mine, [None], retry=0), LOCALS))
            _create_foreign_locals(taken[-1], str(tmp_path / f"job{i}"))
        before = shm_descriptors()
        for _ in range(10):
            assert _get_path(first_free_prefix(mine, [None], retry=0), LOCALS) not in taken
        assert shm_descriptors() == before
    finally:
        for name in taken:
            _posixshmem.shm_unlink(f"/{name}")


def test_a_dataset_that_goes_takes_its_shared_memory_and_file_locks_with_it(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Streaming frees a dataset's segments and never its file locks at exit only; a dataset collected
    earlier held ~14 descriptors and its prefix until then."""
    import gc

    from train.data import shm

    cfg = DataConfig(uri=tiny_dataset, resolution=64, cache_dir=str(tmp_path / "cache"), num_workers=0)
    pinned = pin_version(cfg, read_dataset_manifest(cfg))
    before = shm_descriptors()
    dataset = build_dataset(cfg, pinned, per_rank_batch=4, seed=0)
    dataset.load_state_dict({"epoch": 0, "sample_in_epoch": 4, "num_canonical_nodes": 1, "shuffle_seed": 0})
    assert sum(1 for _ in dataset) == 64 - 4  # an epoch, resumed: its threads have ended
    locks = [p for p in shm.LOCKS_REMOVED_AT_EXIT if p.name.startswith(f"{dataset._shm_prefix_int:06}_")]
    assert registrations_of(pinned.local) and shm_descriptors() > before and all(p.exists() for p in locks)
    del dataset
    gc.collect()
    assert not registrations_of(pinned.local)
    assert shm_descriptors() <= before
    assert locks and not any(p.exists() for p in locks)
    assert not set(locks) & set(shm.LOCKS_REMOVED_AT_EXIT)


HOLD_LOCK = (
    "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
    "print('held', flush=True); time.sleep(60)"
)


def test_a_prefix_lock_held_past_its_timeout_names_the_process_holding_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process stuck (or stopped) while building a dataset holds the host's prefix lock: every other
    build waits PREFIX_LOCK_TIMEOUT_S, then fails naming that process, so the user knows what to stop."""
    lock = streaming_host.prefix_lock_path()
    lock.touch(mode=0o600)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(streaming_host, "PREFIX_LOCK_TIMEOUT_S", 0.3)
        with pytest.raises(streaming_host.DataError, match=rf"held by pid {holder.pid} \(.* -c import fcntl"):
            streaming_host._acquire_prefix_lock()
    finally:
        holder.kill()
        holder.wait()
