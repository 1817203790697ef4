"""The ranks' processes as one node's supervisor (shared/launch/supervisor.py) sees them: the process tree
under torchrun, which of them still run or are stopped, their Python stacks, the /dev/shm files they map,
and, on several nodes, the generations torchrun's elastic agent starts.

Generations: the agent restarts every node's ranks itself (a `c10d` rendezvous, `--max-restarts`), so the
supervisor only sees its ranks' heartbeats (shared/launch/control.py) change hands: the processes that wrote
them are gone, and new processes write them. That change is a restart; the highest step of the generation
that ended is where it failed, and two restarts from the same step are a crash loop.
Light: the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.launch.control import CONTROL_DIR_ENV, Heartbeat, proc_stat

STACK_TIMEOUT_S = 30  # py-spy reads a process's memory; a few seconds even for a large one
RANK_EXIT_GRACE_S = 5.0  # a killed rank's resource tracker and loader workers notice within a second
SHM = "/dev/shm/"


def _parent_of(pid: int) -> int | None:
    stat = proc_stat(pid)
    return None if stat is None else int(stat[1])


def all_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (torchrun starts its ranks in sessions of their own, so a
    process-group kill misses them)."""
    children: dict[int, list[int]] = {}
    for each in all_pids():
        parent = _parent_of(each)
        if parent is not None:
            children.setdefault(parent, []).append(each)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def stack_of(pid: int) -> str:
    """A process's Python stacks, taken from outside (works on a stopped or wedged process)."""
    tool = py_spy()
    if tool:
        try:
            done = subprocess.run(
                [tool, "dump", "--pid", str(pid), "--nonblocking"],
                capture_output=True, text=True, timeout=STACK_TIMEOUT_S, check=False,
            )  # fmt: skip
            if done.returncode == 0:
                return done.stdout
        except subprocess.TimeoutExpired:
            pass
    try:  # without py-spy: the kernel's view (state and where it sleeps)
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        state = next((line for line in status if line.startswith("State:")), "State: ?")
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        return f"{state}; waiting in {wchan or '?'} (install py-spy for Python stacks)"
    except OSError as err:
        return f"unreadable: {err}"


def alive(pid: int) -> bool:
    """A process that still runs (or is stopped); a zombie waiting for its parent counts as gone."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: it cannot answer anything until SIGCONT."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] in ("T", "t")


def kill_ranks_first(parent: int, grace_s: float = RANK_EXIT_GRACE_S) -> None:
    """SIGKILL `parent`'s children (the ranks under torchrun) first and give their own children a moment to
    exit by themselves: Python's resource tracker unlinks a dead rank's semaphores from /dev/shm only if it
    outlives the rank (killing it too left 20 `sem.mp-*` behind in the two-node test). Whatever of the
    tree still runs after `grace_s` is SIGKILLed."""
    tree = descendants(parent)
    ranks = [pid for pid in tree if _parent_of(pid) == parent]
    kill_all(ranks)
    wait_exited([pid for pid in tree if pid not in ranks], grace_s)
    kill_all(tree)


def kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # SIGKILL also ends a SIGSTOPped process


def wait_exited(pids: Iterable[int], timeout_s: float = RANK_EXIT_GRACE_S) -> None:
    """Wait until the processes have exited, at most `timeout_s`. A SIGKILLed process maps its files until
    the kernel has torn it down: a /dev/shm sweep right after the kill kept what it still mapped."""
    deadline = time.monotonic() + timeout_s
    left = [pid for pid in pids if alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [pid for pid in left if alive(pid)]


def processes_whose_environ(match: Callable[[bytes], bool], keep: Iterable[int] = ()) -> list[int]:
    """Processes outside `keep` with an environment entry (`NAME=value` bytes) that `match` accepts."""
    kept, found = set(keep), []
    for pid in all_pids():
        with contextlib.suppress(OSError):
            if pid not in kept and any(map(match, Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))):
                found.append(pid)
    return found


def strays(control_folder: Path, keep: Iterable[int]) -> list[int]:
    """Processes outside `keep` whose environment names `control_folder` as $SD_CONTROL_DIR (every rank and
    whatever it starts inherits it): the children of a rank killed from outside (kill -9, the OOM killer)
    are reparented to init, out of reach of a kill of the launch's process tree, and some never exit by
    themselves (Composer's upload worker waits on a queue whose writing end it holds too)."""
    marker = f"{CONTROL_DIR_ENV}={control_folder}".encode()
    return processes_whose_environ(marker.__eq__, keep)


FileId = tuple[int, int]  # (st_dev, st_ino): an inode number alone is unique only within one file system


def _shm_mappings(pids: Iterable[int], unlinked: bool = True) -> Iterator[tuple[FileId, str]]:
    """(file id, path) of each /dev/shm file the processes map, from /proc/<pid>/maps (its device field is
    `major:minor` in hex); `unlinked=False` leaves out files already unlinked (" (deleted)")."""
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(SHM):
                    if not unlinked and parts[5].endswith(" (deleted)"):
                        continue
                    major, minor = (int(half, 16) for half in parts[3].split(":"))
                    yield (os.makedev(major, minor), int(parts[4])), parts[5].removesuffix(" (deleted)")


def mapped_shm(pids: Iterable[int]) -> set[str]:
    """The /dev/shm files (Python's named semaphores `sem.mp-*`, Streaming's shared memory) the processes
    map: the supervisor unlinks those still there when it exits, since a rank SIGKILLed together with its
    resource tracker (torchrun kills the rank's process group) never unlinks them. Files already unlinked
    are not kept: every DataLoader batch in shared memory is one (`torch_<pid>_...`), and their names grew
    the supervisor's set by 4 a second (1 GB a node over 1M steps of the SD2 recipe); a semaphore whose
    creator still maps its temporary name is found by `orphan_semaphores`."""
    return {path for _, path in _shm_mappings(pids, unlinked=False)}


def unmapped_shm(paths: Iterable[str]) -> set[str]:
    """Those of `paths` (listed before this call) that no process maps now. Compared by file id: glibc's
    sem_open maps a temporary file and only then links it under the semaphore's name, so the creator's maps
    show the temporary name, deleted (by name, every semaphore looked unmapped until a second process
    opened it, and a live one of another job was taken). The device counts too: every tmpfs numbers its
    inodes from 2, so processes with a /dev/shm of their own (another node's, a container's) map files with
    the same inode numbers (by inode alone, the two-node test kept three orphans of node 0's while node 1
    still ran)."""
    ids = {path: file_id for path in paths if (file_id := _file_id(path)) is not None}
    in_use = {file_id for file_id, _ in _shm_mappings(all_pids())}
    return {path for path, file_id in ids.items() if file_id not in in_use}


def _file_id(path: str) -> FileId | None:
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def flock_holders(fd: int) -> list[int]:
    """The processes holding an flock on the file `fd` is open on, from /proc/locks (its file field is
    `major:minor:inode`, the device in hex). The kernel records the pid that took the lock; a child forked
    while it was held holds it too and is not listed."""
    info = os.fstat(fd)
    holders = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if len(parts) < 6 or parts[1] != "FLOCK":  # a waiter's line reads "N: -> FLOCK ..."
                continue
            with contextlib.suppress(ValueError):
                major, minor, inode = parts[5].split(":")
                if (os.makedev(int(major, 16), int(minor, 16)), int(inode)) == (info.st_dev, info.st_ino):
                    holders.append(int(parts[4]))
    return holders


def command_of(pid: int) -> str:
    """A process's command line, for a message ("?" once it has gone)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return "?"
    return " ".join(part.decode("utf-8", "replace") for part in argv) or "?"


def orphan_semaphores(since: float) -> set[str]:
    """Python's named semaphores (`sem.mp-*`) in /dev/shm that this user created at or after `since`: the
    ones no process maps (`unmapped_shm`, called after this scan) lost their creator, so nothing can open
    them again. The poll-time sample of what the ranks map (`mapped_shm`) misses a generation killed within
    one poll of creating them (the two-node test once left one on node 0); this sweep does not depend on the
    timing. Another user's files are never taken (/dev/shm is sticky), nor files older than the run."""
    found = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHM):
            if not entry.name.startswith("sem.mp-"):
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if info.st_uid == os.getuid() and info.st_ctime >= since:
                    found.add(entry.path)
    return found


def forget_shm(paths: Iterable[str]) -> int:
    """Unlink the files (a process of the run mapped them; none is left to use them); how many were there."""
    removed = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    return removed


@dataclass
class Generations:
    """The ranks' processes of the current generation on this node, and the restarts seen so far."""

    pids: set[int] = field(default_factory=set)
    batch: int = -1  # the highest step this generation completed
    restarts: int = 0
    last_failure: int | None = None  # the step the previous restart happened at
    cause: str = "crash"  # what ended the current generation, for the log: crash | hang

    def observe(self, beats: Iterable[Heartbeat], alive: Callable[[int], bool]) -> int | None:
        """Adopt this poll's heartbeats; the ended generation's highest step when a new one has started.

        New pids alone are no restart (a node's ranks write their first heartbeats one after another); new
        pids while some of the generation's processes are gone are. A clean exit writes no new heartbeat."""
        live = [beat for beat in beats if alive(beat.pid)]
        fresh = [beat for beat in live if beat.pid not in self.pids]
        ended = None
        if fresh and any(not alive(pid) for pid in self.pids):
            ended, self.pids, self.batch = self.batch, set(), -1
        for beat in live:
            self.pids.add(beat.pid)
            self.batch = max(self.batch, beat.batch)
        return ended

    def restarted(self, step: int) -> bool:
        """Count a restart from `step`; False when the previous one was from the same step (a crash loop)."""
        if self.last_failure == step:
            return False
        self.restarts, self.last_failure = self.restarts + 1, step
        return True

    def hung(
        self, beats: Iterable[Heartbeat], alive: Callable[[int], bool], now: float, timeout_s: float
    ) -> list[int]:
        """Ranks of this generation, still running (or stopped), whose last step is older than timeout_s; a
        finished rank's heartbeat is kept fresh while its last uploads run, so stale it is a closing hang."""
        return sorted(
            beat.rank
            for beat in beats
            if beat.pid in self.pids and alive(beat.pid) and now - beat.mtime > timeout_s
        )


def stacks_report(hung: list[int], ranks: Mapping[int, int], hang_timeout_s: float) -> list[str]:
    """The supervisor's lines for a hang: which ranks, the stopped ones named (they hold everyone else in
    a collective), then every rank's stack. `ranks`: pid -> rank."""
    held = [f"rank {rank} (pid {pid})" for pid, rank in sorted(ranks.items()) if stopped(pid)]
    why = f"; {', '.join(held)} is stopped (SIGSTOP or a tracer)" if held else ""
    lines = [f"rank(s) {hung} hung (no step for {hang_timeout_s:g} s){why}; stacks follow"]
    return lines + [
        f"--- rank {rank} (pid {pid}) ---\n{stack_of(pid)}"
        for pid, rank in sorted(ranks.items(), key=lambda item: item[1])
    ]
