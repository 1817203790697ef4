"""shared/runtime/children.py: a training rank's loader workers leave its stop signals to it, and end on
its own."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import time
from typing import Any

from shared.runtime.children import RANK_STOP_SIGNALS, rank_loader_worker


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
