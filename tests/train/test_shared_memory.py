"""A training run leaves no Streaming shared memory and no lock files behind, and prints no resource_tracker
warning: a normal run and one stopped by SIGTERM (the killed-rank case is in
tests/train/resilience/test_unattended.py). Segments are attributed by the folders their `_locals` block
names (tests/leftovers.py), so other jobs on this machine do not count."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shared.launch import control
from tests.leftovers import streaming_segments_naming
from tests.train.conftest import PYTHON, REPO_ROOT, tiny_overrides

RUN_TIMEOUT_S = 400


def start_fit(tiny_dataset: str, tmp: Path, *extra: str) -> tuple[subprocess.Popen[str], Path]:
    """`python -m train fit tiny` in a subprocess with its own TMPDIR (Streaming's file locks go there)."""
    (tmp / "tmp").mkdir()
    (tmp / "ctl").mkdir()  # the run's heartbeats (shared/launch/control.py), to know when a step finished
    log = tmp / "run.log"
    overrides = tiny_overrides(tiny_dataset, tmp / "save", tmp / "cache", "samples.enabled=false", *extra)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp / "tmp")}
    env[control.CONTROL_DIR_ENV] = str(tmp / "ctl")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [PYTHON, "-m", "train", "fit", "tiny", *overrides],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    return proc, log


def assert_nothing_left(tmp: Path, log: Path) -> None:
    text = log.read_text()
    assert "resource_tracker" not in text and "leaked shared_memory" not in text, text[-3000:]
    assert streaming_segments_naming([tmp.resolve()]) == []
    assert sorted(p.name for p in (tmp / "tmp").glob("*_filelock")) == []


@pytest.mark.slow
def test_a_finished_run_leaves_no_shared_memory(tiny_dataset: str, tmp_path: Path) -> None:
    proc, log = start_fit(tiny_dataset, tmp_path, "max_duration=3ba")
    assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, log.read_text()[-3000:]
    assert_nothing_left(tmp_path, log)


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_prints_one_line_and_leaves_no_shared_memory(
    tiny_dataset: str, tmp_path: Path
) -> None:
    proc, log = start_fit(tiny_dataset, tmp_path, "max_duration=400ba", "save_interval=200ba")
    deadline = time.time() + RUN_TIMEOUT_S
    while not any(beat.batch >= 2 for beat in control.read_heartbeats(tmp_path / "ctl")):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    # With a control folder (a supervisor's) the rank exits 0 and leaves the 75 to the supervisor, whose
    # torchrun would otherwise restart it (train/resilience/exits.py resumable_exit_code).
    assert proc.wait(timeout=RUN_TIMEOUT_S) == control.EXIT_DONE, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text and "ResumableStop" not in text, text[-3000:]
    stopped = [line for line in text.splitlines() if line.startswith("stopped at batch")]
    assert len(stopped) == 1 and stopped[0].endswith("rerun the same command to resume (exit code 75)")
    assert_nothing_left(tmp_path, log)
