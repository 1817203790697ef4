"""Streaming's shared memory as this process holds it: read without holding, released when a dataset goes.

Streaming registers every segment it creates or attaches for cleanup at exit, which holds its descriptor,
its mapping and its /dev/shm name until the process ends, however long ago its dataset went; and its file
locks are never removed. A process that builds datasets one after another (the bench's sections, a
notebook, the suite's workers) held them all: one bench run, 4,900 descriptors (CI's workers have 1,024).
- other processes' segments are read and unlinked with the POSIX calls themselves (`read_shm`,
  `shm_state`, `unlink_shm`), never attached;
- a dataset's own segments and file locks go when the dataset is collected, or at exit (`release_at_end`);
- the resume state Streaming reads at every epoch is attached without the hold
  (`attached_without_exit_hold`).
"""

from __future__ import annotations

import atexit
import mmap
import os
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

LOCKS_REMOVED_AT_EXIT: list[Path] = []  # Streaming file locks of this process's datasets


# Other processes' segments are read and unlinked with the POSIX calls themselves, never through
# multiprocessing.shared_memory.SharedMemory: on Python < 3.13 attaching one registers it with this process's
# resource tracker, which at exit warns "There appear to be N leaked shared_memory objects" and unlinks it,
# although another live job owns it (that job's next dataset then reuses its prefix; seen as the warning
# after every demo and training run, and as Streaming segments left in /dev/shm after the suite).
def read_shm(name: str) -> bytes | None:
    """The bytes of the POSIX shared memory `name`, or None when there is none (or it is not ours)."""
    state = shm_state(name)
    return state if isinstance(state, bytes) else None


FOREIGN = "foreign"  # shm_state of a segment another user owns: it exists, we may not read it


def shm_state(name: str) -> bytes | str | None:
    """The bytes of the POSIX shared memory `name`; None when there is none; FOREIGN when it is not ours."""
    import _posixshmem

    try:
        fd = _posixshmem.shm_open(f"/{name}", os.O_RDONLY, mode=0o600)
    except FileNotFoundError:
        return None
    except PermissionError:
        return FOREIGN
    try:
        size = os.fstat(fd).st_size
        if not size:
            return b""
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
            return bytes(view)
    finally:
        os.close(fd)


def unlink_shm(name: str) -> int:
    import _posixshmem

    try:
        _posixshmem.shm_unlink(f"/{name}")
    except (FileNotFoundError, PermissionError):
        return 0
    return 1


def release_at_end(dataset: Any) -> Any:
    """Release the dataset's Streaming shared memory, and its two file locks, when the dataset is
    collected or this process exits, whichever comes first; returns the dataset.

    Without it a dataset that went held ~14 descriptors and kept its prefix taken until exit. Streaming
    never removes the file locks (<tmp>/<prefix>_barrier_filelock, _cache_filelock), and its prefix scan
    skips every prefix whose lock file exists: each finished run took one prefix for good (one `make test`
    left 200 files in /tmp and pushed new jobs' prefixes past 60). Only the local leader, which created the
    prefix, removes the locks.
    """
    held = _RELEASED_AT_END.setdefault(dataset, [])
    held.extend(_shared_memory_of(dataset))
    locks = _own_file_locks(dataset)
    if locks and not LOCKS_REMOVED_AT_EXIT:
        atexit.register(_remove_file_locks)
    LOCKS_REMOVED_AT_EXIT.extend(locks)
    weakref.finalize(dataset, _release, os.getpid(), held, locks)
    return dataset


# dataset -> the segments its finalizer releases; beside the dataset, not in it: nothing extra is pickled
_RELEASED_AT_END: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def also_release(dataset: Any, shm: Any) -> None:
    """Add a segment the dataset attached after it was built (its resume state) to what `release_at_end`
    releases."""
    held = _RELEASED_AT_END.get(dataset)
    if held is not None and all(shm is not known for known in held):
        held.append(shm)


def _shared_memory_of(dataset: Any) -> Iterator[Any]:
    """Streaming's SharedMemory objects among the dataset's attributes (directly or inside its shared
    arrays, scalars and barrier)."""
    from streaming.base.shared import SharedArray, SharedBarrier, SharedMemory, SharedScalar

    for value in vars(dataset).values():
        if isinstance(value, SharedBarrier):
            value = value._arr
        if isinstance(value, SharedScalar):
            value = value.arr
        if isinstance(value, SharedArray):
            value = value.shm
        if isinstance(value, SharedMemory):
            yield value


@contextmanager
def attached_without_exit_hold() -> Iterator[None]:
    """Within the block, Streaming's dataset module attaches shared memory without registering it for
    cleanup at exit, so a handle closes once Streaming drops it.

    For `_resume`, which reads the resume state through a fresh attach at every epoch in every process that
    iterates (the rank, or each loader worker) and drops it: registered at exit, each attach held a
    descriptor until the process ended (a resumed run of 1,000 short epochs: 1,000 per worker). The module
    attribute is swapped for the block only; nothing else in that module attaches while an epoch starts.
    """
    import functools

    import streaming.base.dataset as streaming_dataset

    original = streaming_dataset.SharedMemory
    streaming_dataset.SharedMemory = functools.partial(original, auto_cleanup=False)
    try:
        yield
    finally:
        streaming_dataset.SharedMemory = original


def _own_file_locks(dataset: Any) -> list[Path]:
    prefix, root = getattr(dataset, "_shm_prefix_int", None), getattr(dataset, "_filelock_root", None)
    if prefix is None or root is None or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return []
    return file_locks(prefix, root)


def file_locks(prefix_int: int, root: str | None = None) -> list[Path]:
    """Streaming's two file locks of a prefix, in `root` (None: the temp folder, where it puts them)."""
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK
    from streaming.base.shared.prefix import _get_path

    folder = tempfile.gettempdir() if root is None else root
    return [Path(folder, _get_path(prefix_int, n)) for n in (BARRIER_FILELOCK, CACHE_FILELOCK)]


def _release(pid: int, held: list[Any], locks: list[Path]) -> None:
    if os.getpid() != pid:  # a forked loader worker's copy: the segments are its parent's
        return
    for shm in held:
        atexit.unregister(shm.cleanup)
        with suppress(OSError):  # at exit Streaming may have got there first
            shm.cleanup()
    for path in locks:
        path.unlink(missing_ok=True)
        with suppress(ValueError):
            LOCKS_REMOVED_AT_EXIT.remove(path)


def _remove_file_locks() -> None:
    for path in LOCKS_REMOVED_AT_EXIT:
        path.unlink(missing_ok=True)
