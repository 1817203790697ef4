"""What a test run leaves behind in the temp folder and /dev/shm, attributed to this run only.

Several suites (and jobs) may run at once on one machine, so nothing here counts globally:
- the run gets a temp folder of its own under the system one (TMPDIR, which every subprocess inherits;
  pytest's own `tmp_path` folders stay under the system temp folder, where its retention policy and
  rotation apply). At the end, whatever is left in it was left by this run;
- a Streaming shared-memory segment is this run's when its prefix's `_locals` block names a folder under
  this run's temp folder or pytest's base temp folder (Streaming names segments `<prefix>_<what>` and
  records the local folders of each prefix in `<prefix>_locals`).
`conftest.py` starts a run at import and reports (and removes) the leftovers at the end of the session.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHM = Path("/dev/shm")
# What a job may keep in its temp folder after it ends: the Streaming cache, the run's log folder and the
# lease locks (documented defaults of data.cache_dir / log.local_dir, shared.storage.private_temp_dir).
RUN_KEEPS = ("sd-pretrain-streaming-", "sd-pretrain-runs-", "sd-pretrain-locks-")
# A command in a /dev/shm of its own (a private mount namespace with a tmpfs, as a separate host has), then
# what it left there, written to $SHM_LEFT: `unshare -m --propagation private sh -c PRIVATE_SHM sh CMD...`.
PRIVATE_SHM = (
    'mount -t tmpfs -o size=1g tmpfs /dev/shm || exit 97; "$@"; rc=$?; ls -A /dev/shm > "$SHM_LEFT"; exit $rc'
)
RUN_PREFIX = "sd-pretrain-tests-"
PRODUCT_CACHE_PREFIX = "sd-pretrain-"  # shared.storage.private_temp_dir folders (locks, caches, run logs)
INDUCTOR_CACHE_PREFIX = "torchinductor_"  # inductor's default cache: <temp>/torchinductor_<user>
_SEGMENT = re.compile(r"^(\d{6})_[a-z_]+$")  # Streaming's `<prefix>_<what>`


@dataclass
class Run:
    system_temp: Path
    temp: Path  # this run's TMPDIR
    shm_before: set[str] = field(default_factory=set)
    checks: bool = True  # False in a pytest-xdist worker: the controller checks once every worker has ended


def private_shm_works() -> bool:
    """Whether `unshare -m` and a tmpfs mount work here (root or CAP_SYS_ADMIN, util-linux)."""
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def in_private_shm(argv: list[str]) -> list[str]:
    """`argv` in a /dev/shm of its own; what it left there lands in the file $SHM_LEFT names."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", PRIVATE_SHM, "sh", *argv]


@dataclass
class Alone:
    """What a command run alone (`run_alone`) left: entries in its temp folder beyond what a job keeps, and
    in its /dev/shm (None where this machine cannot give it a /dev/shm of its own)."""

    temp: list[str]
    shm: list[str] | None


def run_alone(
    argv: list[str], base: Path, env: dict[str, str], **run: Any
) -> tuple[subprocess.CompletedProcess[str], Alone]:
    """`argv` with a temp folder of its own (`base`/tmp) and, where `unshare -m` works, a /dev/shm of its own,
    as a job on a host of its own has; `run` goes to subprocess.run (cwd, timeout, stdout...). `base` must be
    short: a job's Unix sockets live in its temp folder, and a socket path may not exceed 107 bytes."""
    temp, shm_left = base / "tmp", base / "shm-left"
    temp.mkdir(parents=True)
    private = private_shm_works()
    env = {**env, "TMPDIR": str(temp), "SHM_LEFT": str(shm_left)}
    done = subprocess.run(in_private_shm(argv) if private else argv, env=env, text=True, **run)
    left = sorted(p.name for p in temp.iterdir() if not p.name.startswith(RUN_KEEPS))
    return done, Alone(left, shm_left.read_text().split() if private and shm_left.exists() else None)


@contextlib.contextmanager
def short_folder(prefix: str) -> Iterator[Path]:
    """A folder under /tmp with a short path, removed afterwards: a job keeps Unix sockets in its temp folder
    (multiprocessing's, for Composer's uploader; SeaweedFS's), and a socket path may not exceed 107 bytes,
    which pytest's tmp_path is too deep for."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def start_run() -> Run:
    """A temp folder for this run (TMPDIR for it and its subprocesses); pytest's tmp_path stays in the system
    temp folder. Call before anything caches tempfile.gettempdir(). A pytest-xdist worker runs in the
    controller's folder (TMPDIR, inherited) and leaves the check to it: a worker's own report and exit status
    never reach the terminal or CI."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        temp = Path(tempfile.gettempdir())
        return Run(temp.parent, temp, shm_names(), checks=False)
    system_temp = Path(tempfile.gettempdir())
    temp = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=system_temp))
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", str(system_temp))
    os.environ["TMPDIR"] = str(temp)
    tempfile.tempdir = str(temp)
    return Run(system_temp, temp, shm_names())


def shm_names() -> set[str]:
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


def streaming_prefixes_naming(roots: list[Path], names: set[str] | None = None) -> set[str]:
    """Prefixes (`000012`) whose Streaming `_locals` block names a folder under one of `roots`."""
    from train.data.shm import read_shm

    found = set()
    for name in sorted(shm_names() if names is None else names):
        match = _SEGMENT.match(name)
        if not match or not name.endswith("_locals"):
            continue
        data = read_shm(name)
        if data is None or len(data) < 4:
            continue
        folders = data[4 : int.from_bytes(data[:4], "little")].decode("utf-8", "replace").split("\0")[:-1]
        if any(_under(folder, roots) for folder in folders):
            found.add(match.group(1))
    return found


def streaming_segments_naming(roots: list[Path]) -> list[str]:
    """Every /dev/shm segment of a Streaming prefix registered for a folder under `roots`."""
    prefixes = streaming_prefixes_naming(roots)
    return sorted(n for n in shm_names() if (m := _SEGMENT.match(n)) and m.group(1) in prefixes)


def _under(folder: str, roots: list[Path]) -> bool:
    path = os.path.abspath(folder)
    return any(path == str(r) or path.startswith(f"{r}{os.sep}") for r in roots)


def _removed_at_exit() -> set[str]:
    """What this process removes at interpreter exit, after this check runs: live TemporaryDirectory objects
    (torch makes one at import), its datasets' Streaming file locks, and the per-user caches kept across
    jobs by design, removed here with the run's temp folder: the product's (`sd-pretrain-*`) and inductor's
    default one (`torchinductor_<user>`, a compiled run without compile_cache_dir)."""
    live = [
        o for o in gc.get_objects() if type(o) is tempfile.TemporaryDirectory
    ]  # not isinstance: proxies warn
    names = {Path(o.name).name for o in live}
    mp_temp = getattr(sys.modules.get("multiprocessing.process"), "current_process", lambda: None)()
    if mp_temp is not None and mp_temp._config.get("tempdir"):  # multiprocessing's pymp-*, a finalizer's
        names.add(Path(mp_temp._config["tempdir"]).name)
    host = sys.modules.get("train.data.shm")
    names |= {p.name for p in getattr(host, "LOCKS_REMOVED_AT_EXIT", [])}
    caches = (f"{PRODUCT_CACHE_PREFIX}*", f"{INDUCTOR_CACHE_PREFIX}*")
    return names | {p.name for pattern in caches for p in Path(tempfile.gettempdir()).glob(pattern)}


def is_ended_manager_folder(entry: Path) -> bool:
    """A multiprocessing Manager's server folder (`pymp-*` holding only its `listener-*` socket), left when
    the server was ended by its owner's 1 s shutdown timeout (SIGTERM: no cleanup), which a loaded 2-core
    box makes likely. Composer's RemoteUploader starts such a Manager for every s3:// save folder
    (composer/utils/remote_uploader.py): its leftover, now and then, not the project's."""
    try:
        inside = list(entry.iterdir()) if entry.name.startswith("pymp-") and entry.is_dir() else []
    except OSError:
        return False
    return bool(inside) and all(child.name.startswith("listener-") for child in inside)


def finish_run(run: Run, basetemp: Path | None) -> tuple[list[str], list[str]]:
    """Lines naming what this run left behind (nothing: []) and what it left that is tolerated (a Manager
    folder of Composer's, `is_ended_manager_folder`), after removing both."""
    if not run.checks:
        return [], []
    lines, tolerated = [], []
    roots = [run.temp.resolve(), *([basetemp.resolve()] if basetemp else [])]
    later = _removed_at_exit()
    alive = {name[:6] for name in later if _SEGMENT.match(name.removesuffix("_filelock"))}  # our datasets'
    ours = [name for name in streaming_segments_naming(roots) if name[:6] not in alive]
    if ours:
        lines.append(f"/dev/shm: {len(ours)} Streaming segment(s) of this run: {', '.join(ours)}")
        for name in ours:
            (SHM / name).unlink(missing_ok=True)
    entries = sorted(p for p in run.temp.iterdir() if p.name not in later) if run.temp.is_dir() else []
    managers = [entry for entry in entries if is_ended_manager_folder(entry)]
    left = [entry for entry in entries if entry not in managers]
    if left:
        shown = ", ".join(p.name for p in left[:20]) + (" ..." if len(left) > 20 else "")
        lines.append(f"{run.temp}: {len(left)} entr(y/ies) left in this run's temp folder: {shown}")
    if managers:
        names = ", ".join(p.name for p in managers)
        tolerated.append(f"{run.temp}: {len(managers)} Manager folder(s) of a server ended unclean: {names}")
    for entry in entries:
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    _remove_at_exit(run.temp)
    return lines, tolerated


def _remove_at_exit(folder: Path) -> None:
    """The run's temp folder goes after everything removed at exit: multiprocessing's finalizers run lowest
    priority last, and its own pymp-* folder is removed at priority -100 (multiprocessing/util.py)."""
    from multiprocessing import util

    util.Finalize(None, shutil.rmtree, args=(str(folder),), kwargs={"ignore_errors": True}, exitpriority=-101)


def processes_naming(folder: Path) -> list[int]:
    """Live processes whose environment names a path under `folder` (a run's TMPDIR, control folder...):
    after the run none may be left (a rank killed from outside leaves children reparented to init)."""
    from shared.launch.ranks import alive, processes_whose_environ

    marker = f"{folder}/".encode()
    return [pid for pid in processes_whose_environ(lambda entry: marker in entry) if alive(pid)]
