"""shared/runtime/children.py: a training rank's loader workers leave its stop signals to it, and end on
its own; a temp folder too long for the workers' sockets is refused with the fix."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import tempfile
import time
from typing import Any

import pytest

from shared.runtime.children import RANK_STOP_SIGNALS, rank_loader_worker, worker_handover_problem


def _a_loader_worker(ready: Any) -> None:
    rank_loader_worker()
    ready.set()
    while True:
        time.sleep(1)


def test_a_loader_worker_outlives_stop_signals_from_anyone_but_its_rank() -> None:
    """slurmstepd signals every process of a job step: the worker stays for its rank to save the step.
    The rank's own SIGTERM (torch's last resort, multiprocessing's at exit) still ends it."""
    context = multiprocessing.get_context("fork")  # as torch's loader workers start on Linux
    ready = context.Event()
    worker = context.Process(target=_a_loader_worker, args=(ready,), daemon=True)
    worker.start()
    try:
        assert ready.wait(30)
        for sig in RANK_STOP_SIGNALS:  # sent by another process, as slurmstepd's are
            subprocess.run(["kill", "-s", sig.name.removeprefix("SIG"), str(worker.pid)], check=True)
        time.sleep(0.5)
        assert worker.is_alive()
        worker.terminate()
        worker.join(timeout=10)
        assert worker.exitcode == 128 + signal.SIGTERM
    finally:
        worker.kill()
        worker.join()


def test_a_temp_folder_too_long_for_a_workers_socket_is_named_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """multiprocessing hands a worker's tensor over through <temp>/pymp-XXXXXXXX/listener-XXXXXXXX, a Unix
    socket of at most 107 bytes: 75 bytes of temp folder fit (a real `train fit` with 2 workers ran there),
    a longer one hung the process waiting for the worker's first batch."""
    fits = "/tmp/" + "y" * 70
    monkeypatch.setattr(tempfile, "tempdir", fits)
    assert len(fits) == 75 and worker_handover_problem("data.num_workers=0") is None
    monkeypatch.setattr(tempfile, "tempdir", fits + "y")
    problem = worker_handover_problem("data.num_workers=0")
    assert problem is not None and "(76 bytes)" in problem and "at most 75 bytes" in problem
    assert problem.endswith("set TMPDIR to a shorter folder (e.g. TMPDIR=/tmp), or data.num_workers=0")
