"""Suite-wide fixtures: a real S3 server (SeaweedFS) on loopback, the gpu auto-skip, and the leftover check.

The S3 server (shared/storage/s3_server.py, which `make bench` starts the same way) runs once per test
session with every port picked on 127.0.0.1 (parallel CI jobs cannot collide) and an identities file, so
boto3's signed requests are really verified. `S3_ENDPOINT_URL` + AWS credentials are exported for the
session, which points both `shared.storage` and MosaicML Streaming (it reads the same variable) at it.

The run gets a temp folder of its own (TMPDIR, tests/leftovers.py); pytest keeps `tmp_path` folders only
for failed tests (pyproject: tmp_path_retention_policy). At the end the session lists, then removes,
whatever it left in its temp folder and the Streaming segments it left in /dev/shm; with
SD_TESTS_STRICT_LEFTOVERS=1 such leftovers fail the run. Under pytest-xdist the workers share the
controller's temp folder and the controller checks once they have all ended (tests/leftovers.py start_run).
"""

from __future__ import annotations

import os

# Before anything loads torch (libgomp reads this once, at load). OpenMP threads that spin-wait for work
# starve each other when two suites (or a suite and a job) share 2 cores: the 600-step learning test took
# >900 s with two concurrent suites instead of 121 s alone; with passive waiting two concurrent demo
# trainings took 160 s each. Subprocesses the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import re
import resource
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import leftovers

# CI's machines give a process 1,024 open files (soft limit); here it may be far more, and a descriptor leak
# that exhausts a CI worker (every later test of that worker then fails with EMFILE) passed here unseen.
# The suite runs under CI's limit everywhere; its subprocesses inherit it.
CI_OPEN_FILES = 1024
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if _soft == resource.RLIM_INFINITY or _soft > CI_OPEN_FILES:
    resource.setrlimit(resource.RLIMIT_NOFILE, (CI_OPEN_FILES, _hard))

RUN = leftovers.start_run()  # before anything caches the temp folder

from shared.storage.s3_server import S3Server, pointed_at, run_seaweedfs  # noqa: E402

STRICT_LEFTOVERS_ENV = "SD_TESTS_STRICT_LEFTOVERS"
_LEFT: list[str] = []
_TOLERATED: list[str] = []  # reported, never failed (tests/leftovers.py is_ended_manager_folder)
# A test that leaves more descriptors open than this is named in the summary: a module or session fixture
# may keep a few (the S3 server's pipes), a leak keeps one or more per dataset, trainer or client.
DESCRIPTORS_HELD_LIMIT = 48
_HELD: list[str] = []

# -------------------------------------------------------------------------------------- collection
S3_FIXTURES = ("s3_server", "s3_prefix")
# Session fixtures too costly to build once per xdist worker: `make demo` and `make bench` for real (~2 CPU
# minutes each) and the trained tiny checkpoint (tests/train/conftest.py).
ONE_WORKER_FIXTURES = ("demo_run", "bench_alone", "tiny_run")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, so the s3 marks added here count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_s3_users(items)
    skip_gpu_tests_without_cuda(items)
    group_for_workers(config, items)


def mark_s3_users(items: list[pytest.Item]) -> None:
    """A test that takes an S3 fixture is an `s3` test even if its author forgot the mark."""
    for item in items:
        uses_s3 = any(name in S3_FIXTURES for name in getattr(item, "fixturenames", ()))
        if uses_s3 and not item.get_closest_marker("s3"):
            item.add_marker(pytest.mark.s3)


def group_for_workers(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`): a module's tests stay on one
    worker, so its module fixtures are built once; the users of an expensive session fixture share one worker,
    so it is built once a run; and the slow groups are handed out first, so no long one starts last (xdist
    keeps this order only with --no-loadscope-reorder, which the Makefile passes; by default it hands out
    the groups with the most tests first).

    The scheduler reads the node ids and their order from the workers' collections, so the marks are added
    in the workers (`workerinput`), whose own options say neither `-n` nor `--dist`."""
    if not hasattr(config, "workerinput"):
        return
    groups: dict[pytest.Item, str] = {}
    for item in items:
        used = getattr(item, "fixturenames", ())
        module = item.nodeid.split("::")[0]
        groups[item] = next((name for name in ONE_WORKER_FIXTURES if name in used), module)
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    slow = {groups[item] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: groups[item] not in slow)  # stable: collection order within each half


def skip_gpu_tests_without_cuda(items: list[pytest.Item]) -> None:
    """Skip `gpu` tests when no CUDA device is present (torch is imported only if any were collected)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


# ------------------------------------------------------------------------------------- SeaweedFS S3
@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A SeaweedFS S3 server for the whole session, with the process environment pointed at it."""
    workdir = Path(tempfile.mkdtemp(prefix="sd-pretrain-s3-"))
    try:
        with run_seaweedfs(workdir) as server, pointed_at(server, workdir):
            yield server
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _safe_name(name: str) -> str:
    """A test name usable as an S3 key segment (parametrize ids carry brackets and slashes)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")[:80] or "test"


@pytest.fixture
def s3_prefix(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh `s3://<bucket>/<test-name>-<uuid>` prefix no other test writes under."""
    return f"s3://{s3_server.bucket}/{_safe_name(request.node.name)}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def killed_temp() -> Iterator[Path]:
    """The temp folder (TMPDIR) for the processes a test kills -9 or lets leave by os._exit: what they would
    have removed at exit (Streaming's file locks, torch's import-time temp folder, a compile cache) is the
    test's doing, so it stays here and goes with the test, not into the run's temp folder, where it reads
    as a leak. Short: a job keeps Unix sockets in its temp folder (at most 107 bytes a path)."""
    with leftovers.short_folder("sdk-") as base:
        yield base


# ------------------------------------------------------------------------------------------- leftovers
def _open_descriptors() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no procfs: not counted
        return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_DESCRIPTORS_BEFORE] = _open_descriptors()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """On the teardown report (which reaches the xdist controller), how many more descriptors the worker
    holds than before the test's setup."""
    outcome = yield
    before = item.stash.get(_DESCRIPTORS_BEFORE, None)
    after = _open_descriptors() if call.when == "teardown" else None
    if before is not None and after is not None and after - before > DESCRIPTORS_HELD_LIMIT:
        outcome.get_result().user_properties.append(("descriptors_held", after - before))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == "descriptors_held":
            _HELD.append(f"{report.nodeid}: {value} more open descriptors after it than before it")


_DESCRIPTORS_BEFORE = pytest.StashKey[int | None]()


@pytest.hookimpl(trylast=True)  # after pytest removed a passing session's tmp_path folders
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    factory = getattr(session.config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None)
    _LEFT[:], _TOLERATED[:] = leftovers.finish_run(RUN, basetemp)
    if (_LEFT or _HELD) and os.environ.get(STRICT_LEFTOVERS_ENV) == "1" and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _HELD:
        limit = f"a worker may hold {CI_OPEN_FILES}, as on CI"
        terminalreporter.write_sep("=", f"tests that left descriptors open ({limit})", yellow=True)
        for line in _HELD:
            terminalreporter.write_line(line)
    if _LEFT:
        terminalreporter.write_sep("=", "left behind by this run (now removed)", yellow=True)
        for line in _LEFT:
            terminalreporter.write_line(line)
    if _TOLERATED:
        terminalreporter.write_sep("=", "left behind by libraries, tolerated (now removed)", yellow=True)
        for line in _TOLERATED:
            terminalreporter.write_line(line)
