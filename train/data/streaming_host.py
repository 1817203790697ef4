"""What Streaming shares between processes on one host, made safe: its cache folders and its shm prefixes.

- two live StreamingDatasets may not share a local folder, and a process killed with SIGKILL leaves its
  shared-memory registration of that folder behind, which makes the restarted run fail with "Reused local
  directory". We hold an flock on the folder for the life of the process (the kernel drops it when the
  process dies), and whoever gets the lock removes registrations of *that* folder only.
- Streaming picks its shared-memory prefix by check-then-create, so two datasets built at the same moment
  on one host collide (FileExistsError '/0000NN_locals'; mosaicml/streaming #884, #901): construction
  holds a per-user lock (`streaming_prefix_lock`), and a prefix another process registered between the scan
  and the create is scanned past (`register_free_prefix`): the lock lives in the temp folder, and two jobs
  with different TMPDIRs (a Slurm prologue's per-job folder, two test sessions) share /dev/shm but not the
  lock (3 of 80 simultaneous builds failed that way, and `train fit` took it for a fatal path error).
- every rank of a node scans for that prefix on its own, before the ranks meet: a segment another job
  unlinks between two ranks' scans (its process exiting) makes them pick different prefixes, and the later
  rank dies with FileNotFoundError '/0000NN_locals'. During construction the node's local leader alone
  scans and the ranks take its choice (`agreed_shm_prefix`).
- Streaming's prefix scan attaches every live segment it passes and holds it until exit: a process that
  built datasets one after another held a quadratic number of descriptors. The scan here reads and closes
  (`first_free_prefix`); each dataset built here is released when it goes (train/data/shm.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shared import storage
from train.data.shm import file_locks, read_shm, release_at_end, shm_state, unlink_shm

log = logging.getLogger(__name__)

_LOCK_NAME = ".sd-pretrain.lock"
_PREFIX_LOCK_NAME = "streaming-shm-prefix.lock"
PREFIX_LOCK_TIMEOUT_S = 600.0  # another job's dataset construction takes seconds; this only breaks a deadlock
_PREFIX_LOCK_POLL_S = 0.05
_held_locks: dict[str, int] = {}  # local dir -> open fd holding its flock (released when the process exits)


class DataError(ValueError):
    """The dataset cannot be streamed as configured; the message names the fix."""


def cache_limit_refusal(limit: object, err: ValueError) -> ValueError:
    """Streaming's refusal of a cache_limit below what the dataset needs (4 of its largest shards, raw and
    zipped, and its indexes) as a DataError naming the setting; any other ValueError as it is. Streaming
    raised it in every rank with a traceback."""
    if not limit or "cache limit" not in str(err).lower():
        return err
    return DataError(
        f"data.cache_limit={limit} is too small for this dataset: {' '.join(str(err).split())} Raise "
        "data.cache_limit (a node's ranks and workers each read several shards at once: docs/cluster.md), "
        "or set it to null to keep every downloaded shard"
    )


# ------------------------------------------------------------------------------- local dir ownership
def claim_local_dir(local: str) -> None:
    """Lock `local` for this process and clear stale Streaming registrations of it left by a killed run.

    Only the node's local leader claims (ranks on a node share the folder by design). Raises when another
    live process holds the folder.
    """
    if int(os.environ.get("LOCAL_RANK", "0")) != 0 or local in _held_locks:
        return
    Path(local).mkdir(parents=True, exist_ok=True)
    fd = os.open(os.path.join(local, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataError(
            f"another process is streaming through {local}: two live StreamingDatasets may not share a "
            "cache folder; give this run its own data.cache_dir"
        ) from None
    _held_locks[local] = fd
    removed = remove_stale_registrations(local)
    if removed:
        log.warning("removed %d stale Streaming shared-memory registration(s) of %s", removed, local)


def remove_stale_registrations(local: str) -> int:
    """Unlink Streaming shared memory that registered `local` (only called while we hold its lock)."""
    # Streaming 0.13 internals: prefixes are scanned from 0 until a free one, LOCALS lists each prefix's
    # local folders. Any prefix that names our folder belongs to a dead process, since we hold the lock.
    from streaming.base.constant import LOCALS, SHM_TO_CLEAN
    from streaming.base.shared.prefix import _get_path, _unpack_locals

    removed = 0
    target = os.path.abspath(local)
    for prefix_int in range(1 << 16):
        registered = read_shm(_get_path(prefix_int, LOCALS))
        locks = file_locks(prefix_int)
        if registered is None:
            if any(p.exists() for p in locks):
                continue
            break
        their_locals, _ = _unpack_locals(registered)
        if target not in (os.path.abspath(p) for p in their_locals):
            continue
        for name in SHM_TO_CLEAN:
            removed += unlink_shm(_get_path(prefix_int, name))
        for path in locks:
            path.unlink(missing_ok=True)
    return removed


@contextmanager
def streaming_prefix_lock() -> Iterator[Callable[[Any], Any]]:
    """Serialise StreamingDataset construction among this user's processes on this host.

    Streaming's `get_shm_prefix` scans for the first free shared-memory prefix, meets the other ranks in a
    barrier, then creates it: two datasets built at once pick the same prefix and one dies with
    FileExistsError. The node's local leader holds the lock over the whole construction; under
    torch.distributed every rank waits in a barrier until its leader holds it, so the other local ranks
    scan only while no other job can register. The lock file is per user (a shared one could be held by
    anyone to stall us); jobs of different users on one host are not serialised.

    Yields `created`: pass it each dataset built, so its shared memory and file locks go when the dataset
    does (`release_at_end`).
    """
    import torch.distributed as torch_dist

    distributed = torch_dist.is_available() and torch_dist.is_initialized()
    fd = _acquire_prefix_lock() if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    try:
        if distributed:
            torch_dist.barrier()
        with _prefix_agreed_per_node():
            yield release_at_end
    finally:
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock


@contextmanager
def _prefix_agreed_per_node() -> Iterator[None]:
    """StreamingDataset construction with `agreed_shm_prefix` in place of Streaming's `get_shm_prefix`."""
    import streaming.base.dataset as streaming_dataset

    original = streaming_dataset.get_shm_prefix
    streaming_dataset.get_shm_prefix = agreed_shm_prefix
    try:
        yield
    finally:
        streaming_dataset.get_shm_prefix = original


def agreed_shm_prefix(
    streams_local: list[str], streams_remote: list[str | None], world: Any, retry: int = 100
) -> tuple[int, Any]:
    """Streaming 0.13's `get_shm_prefix` (register the node's prefix, recording its local folders), with one
    scan per node: the local leader registers a free prefix (`register_free_prefix`) and every rank takes
    its node's leader's choice.

    Upstream each rank scans, then the ranks meet in a barrier and the leader creates the prefix it found;
    when another job's segments go between two ranks' scans, a rank looks for a prefix nobody created.
    """
    import torch.distributed as torch_dist
    from streaming.base.constant import LOCALS
    from streaming.base.shared import SharedMemory
    from streaming.base.shared import prefix as shm_prefix

    shm_prefix._check_self(streams_local)
    registered = register_free_prefix(streams_local, streams_remote, retry) if world.is_local_leader else None
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        assert registered is not None  # one process: its own leader
        return registered
    choices: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(choices, (world.node, None if registered is None else registered[0]))
    prefix_int = next(p for node, p in choices if node == world.node and p is not None)
    if registered is not None:
        return registered
    shm = SharedMemory(shm_prefix._get_path(prefix_int, LOCALS), False)
    their_locals, _ = shm_prefix._unpack_locals(bytes(shm.buf))
    if their_locals != streams_local:
        raise DataError(
            f"the ranks of one node stream different local folders ({streams_local} here, "
            f"{their_locals} on its first rank): data.cache_dir must name the same folder on every rank"
        )
    return prefix_int, shm


REGISTER_ATTEMPTS = 50  # scans after another process took the prefix found (each takes milliseconds)


def register_free_prefix(
    streams_local: list[str], streams_remote: list[str | None], retry: int
) -> tuple[int, Any]:
    """Scan for the first free prefix and create its LOCALS segment; scan again when another process
    created it between the scan and the create (FileExistsError)."""
    from streaming.base.constant import LOCALS
    from streaming.base.shared import SharedMemory
    from streaming.base.shared import prefix as shm_prefix

    for _ in range(REGISTER_ATTEMPTS):
        prefix_int = first_free_prefix(streams_local, streams_remote, retry)
        data = shm_prefix._pack_locals(streams_local, prefix_int)
        try:
            shm = SharedMemory(shm_prefix._get_path(prefix_int, LOCALS), True, len(data))
        except FileExistsError:
            continue
        shm.buf[: len(data)] = data
        return prefix_int, shm
    raise DataError(
        f"{REGISTER_ATTEMPTS} Streaming shared-memory prefixes were taken by other processes as this one "
        "registered them; too many datasets are being built on this host at once: rerun"
    )


def first_free_prefix(streams_local: list[str], streams_remote: list[str | None], retry: int) -> int:
    """The first prefix with no Streaming file lock in the temp folder and none of its segments in use,
    checking that no live registration streams one of our remote streams into one of our local folders
    (retried `retry` times a tick apart, as upstream: a dataset being torn down unregisters late).

    Streaming 0.13's own scan (`_check_and_find`) attaches every live segment it passes with its
    SharedMemory, which registers each for cleanup at exit and so holds its descriptor and mapping until
    the process ends: a process that builds datasets one after another held a quadratic number of
    descriptors (the bench's data section alone: 4,700; the suite's workers hit their limit of 1,024, and
    then every test failed with EMFILE). Here every segment is read and closed at once (`read_shm`).
    """
    from streaming.base.constant import LOCALS, SHM_TO_CLEAN, TICK
    from streaming.base.shared.prefix import _get_path, _unpack_locals

    for attempt in range(1 + retry):
        for prefix_int in range(1 << 16):
            if any(p.exists() for p in file_locks(prefix_int)):
                continue
            states = {name: shm_state(_get_path(prefix_int, name)) for name in SHM_TO_CLEAN}
            if all(state is None for state in states.values()):
                return prefix_int
            registered = states[LOCALS]
            if isinstance(registered, bytes) and registered and any(streams_remote):
                their_locals, _ = _unpack_locals(registered)
                if any(
                    remote is not None and local in their_locals
                    for local, remote in zip(streams_local, streams_remote, strict=True)
                ):
                    break  # a live dataset still streams into our folder: wait a tick, scan again
        else:
            raise DataError(
                "no free Streaming shared-memory prefix among 65,536: clear /dev/shm of dead jobs"
            )
        if attempt < retry:
            time.sleep(TICK)
    raise DataError(
        f"another live StreamingDataset streams into one of {streams_local}: "
        "give this run its own data.cache_dir"
    )


def lock_holders(fd: int) -> str:
    """Who holds the flock on `fd`'s file, for a message: pids and command lines (a lock that waited its
    whole timeout is held by a stuck or stopped process, which the user has to find)."""
    from shared.launch.ranks import command_of, flock_holders

    found = [f"pid {pid} ({command_of(pid)[:200]})" for pid in flock_holders(fd)]
    return ", ".join(found) or "another of your processes (or a child it forked while holding it)"


def prefix_lock_path() -> Path:
    """The per-user host lock over StreamingDataset construction (`streaming_prefix_lock`)."""
    return (
        storage.private_temp_dir("sd-pretrain-locks", "TMPDIR (the environment variable)") / _PREFIX_LOCK_NAME
    )


def _acquire_prefix_lock() -> int:
    path = prefix_lock_path()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + PREFIX_LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                holders = lock_holders(fd)
                os.close(fd)
                raise DataError(
                    f"waited {PREFIX_LOCK_TIMEOUT_S:.0f} s for {path}, held by {holders} building a "
                    "StreamingDataset on this host; if that process is stuck, stop it"
                ) from None
            time.sleep(_PREFIX_LOCK_POLL_S)
