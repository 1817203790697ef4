"""The files a supervisor (shared/launch/supervisor.py) and the ranks it runs share, in one node-local folder.

The supervisor creates the folder and passes it to every rank as $SD_CONTROL_DIR (torchrun hands its
environment on). The ranks write; the supervisor reads, except `stop`, which goes the other way:
- `heartbeat-rank<R>`: "<batch> <pid> <start>", rewritten after every step; its mtime is the rank's last sign
  of life. `<start>`: when that process started (/proc), so a dead rank's pid taken by another process is
  no live rank. "... finished" once training ended: closing (the last upload, a barrier) is not a hang.
- `progress.json` (local rank 0, so every node's supervisor has one): the last batch and the checkpoint
  saved, so a supervisor that gives up can name what a rerun resumes from.
- `exit.json` (local rank 0): why the ranks stopped when they stopped on purpose (`resumable`: saved on a
  signal or a deadline; `fatal`: an error no restart can fix, with its message). After a resumable stop the
  ranks exit 0 (torchrun's elastic agent restarts ranks that exit otherwise) and the supervisor exits 75.
- `stop`: the supervisor's request to save and exit (it got SIGTERM / SIGUSR1); every rank looks for it at
  the step boundary and the ranks agree on it with one all-reduce.
The ranks' TMPDIR is `<folder>/tmp`: what torchrun, Streaming (file locks), multiprocessing and Composer
put in the temp folder goes there and is removed with the folder when the supervisor exits, also after a
rank was killed; $SD_NODE_TMPDIR names the node's own temp folder, where what outlives a launch goes (the
default Streaming cache and log folder, shared/storage/safety.py).
$SD_DEADLINE (seconds since the epoch) is when the ranks must have saved and stopped (a Slurm job's end time
less the lead time a save needs). Light: no torch, so encode and planning can import it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONTROL_DIR_ENV = "SD_CONTROL_DIR"
CONTROL_PREFIX = "sd-control-"  # the supervisor's folder in the node's temp folder
SCRATCH_DIR = "tmp"  # the ranks' TMPDIR inside the control folder
DEADLINE_ENV = "SD_DEADLINE"
STOP_FILE = "stop"
PROGRESS_FILE = "progress.json"
EXIT_FILE = "exit.json"
HEARTBEAT_PREFIX = "heartbeat-rank"

# Exit codes of `python -m train fit` and of the supervisor (documented in docs/running-unattended.md).
EXIT_DONE = 0
EXIT_GAVE_UP = 1  # restarts spent, or the same failure again at the same step: a person has to look
EXIT_FATAL = 2  # a config / data / NaN error that no restart fixes; the message names it
EXIT_RESUMABLE = 75  # saved and stopped on a signal or a deadline (EX_TEMPFAIL): rerun the same command


def adopt_agent_node_rank(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Under torchrun's elastic agent the rendezvous numbers the nodes (GROUP_RANK, and RANK follows it), not
    the launcher: Composer's NODE_RANK (per-node file names) must agree with it, so a rank takes it from
    there. Without an agent (a Slurm array task, a test) NODE_RANK stays as the launcher set it."""
    if "GROUP_RANK" in environ:
        environ["NODE_RANK"] = environ["GROUP_RANK"]


def control_dir() -> Path | None:
    """This rank's control folder, or None when it runs without a supervisor."""
    value = os.environ.get(CONTROL_DIR_ENV)
    return Path(value) if value else None


def deadline() -> float | None:
    value = os.environ.get(DEADLINE_ENV)
    return float(value) if value else None


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Atomically (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


OWNER_FILE = "owner"  # "<pid> <start>" of the supervisor that made the folder


def write_owner(folder: Path) -> None:
    pid = os.getpid()
    (folder / OWNER_FILE).write_text(f"{pid} {process_start(pid) or 0}")


def owner_is_gone(folder: Path) -> bool:
    """Whether the supervisor that made `folder` has ended (False without a readable owner record)."""
    try:
        pid, start = (int(part) for part in (folder / OWNER_FILE).read_text().split())
    except (OSError, ValueError):
        return False
    return not is_running(pid, start)


def write_heartbeat(folder: Path, rank: int, batch: int, finished: bool = False) -> None:
    end = " finished" if finished else ""
    pid = os.getpid()
    (folder / f"{HEARTBEAT_PREFIX}{rank}").write_text(f"{batch} {pid} {process_start(pid) or 0}{end}")


def proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (state, ppid, ...); None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def is_running(pid: int, start: int) -> bool:
    """Whether the process `pid` that started at `start` still runs: not gone, not a zombie waiting for its
    parent (a SIGKILLed rank before torchrun reaps it), not another process that reused the pid."""
    stat = proc_stat(pid)
    return bool(start) and stat is not None and stat[0] not in ("Z", "X") and int(stat[19]) == start


def process_start(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); None where there is none.

    A pid is reused once its process is gone, soon where pid_max is 32768 (a 2-core machine): a dead rank's
    heartbeat, its pid taken by another process, looked like a live rank that had not stepped for minutes.
    The supervisor then "found" a hang at the step the dead generation had reached, killed the healthy new
    generation, and took the second such hang at one step for a crash loop (the two-node test, in CI)."""
    stat = proc_stat(pid)
    return None if stat is None else int(stat[19])  # the fields after "(comm)" start at field 3


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    batch: int
    pid: int
    mtime: float
    finished: bool = False  # training ended; the rank is closing (no more steps to wait for)


def read_heartbeats(folder: Path) -> list[Heartbeat]:
    """The ranks' heartbeats, less those whose pid another process has taken since (`process_start`)."""
    beats = []
    for path in folder.glob(f"{HEARTBEAT_PREFIX}*"):
        try:
            batch, pid, *rest = path.read_text().split()
            finished = rest[-1:] == ["finished"]
            start = int(rest[0]) if rest and rest[0] != "finished" else 0
            rank, mtime = int(path.name[len(HEARTBEAT_PREFIX) :]), path.stat().st_mtime
        except (OSError, ValueError):
            continue  # being rewritten: read again on the next poll
        if start and process_start(int(pid)) not in (None, start):
            continue  # its rank is gone and its pid is another process's now
        beats.append(Heartbeat(rank, int(batch), int(pid), mtime, finished))
    return sorted(beats, key=lambda beat: beat.rank)


def request_stop(folder: Path, reason: str) -> None:
    (folder / STOP_FILE).write_text(reason)


def stop_requested(folder: Path) -> bool:
    return (folder / STOP_FILE).exists()


def clear_attempt(folder: Path) -> None:
    """Before a (re)start: no heartbeat, exit record or stop request of the previous attempt remains."""
    for path in [*folder.glob(f"{HEARTBEAT_PREFIX}*"), folder / EXIT_FILE, folder / STOP_FILE]:
        path.unlink(missing_ok=True)


def remove_dead_control_folders(temp: Path) -> int:
    """Remove `sd-control-*` folders whose supervisor is gone: one SIGKILLed with its node (a node lost
    whole, rerun in place) never removed its own, and it held the ranks' scratch TMPDIR with Composer's
    staged checkpoint copies (two of 14 GB each for SD2-base) for good. A folder without an owner record
    (an older supervisor's, or one just created) is left alone."""
    removed = 0
    for folder in temp.glob(f"{CONTROL_PREFIX}*"):
        if folder.is_dir() and not folder.is_symlink() and owner_is_gone(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    return removed
