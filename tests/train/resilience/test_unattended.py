"""Issue 23, tried as a user would on 2 CPU ranks (gloo, torchrun) with the tiny preset: each failure ends
with the run finished by itself (or stopped with a clear message) and weights equal to an uninterrupted run.

- SIGTERM to `python -m train launch` mid-run, or to every process of the job as slurmstepd sends it (loader
  workers too): saves the current step, exits 75; the rerun resumes it.
- resilience.max_wall_time: saves at the step the limit passes, exits 75; save_interval_minutes saves on the
  clock between batch-interval saves.
- kill -9 of one rank: the supervisor restarts the job from the last checkpoint by itself.
- kill -9 of `train launch` itself: torchrun and the ranks end with it.
- SIGSTOP of one rank: declared hung after resilience.hang_timeout_s, stacks logged (from outside), restart.
- a deterministic failure (a rank killed at the same step each time): stops after one restart, naming the
  step and the checkpoint a rerun resumes from; the rerun finishes.
- the rendered Slurm script under bash with SLURM_* set and recording scontrol / srun stubs: USR1 to the batch
  shell saves and requeues; a job whose EndTime is already within the lead saves after one step and
  requeues; the last segment finishes.
One uninterrupted run (a module fixture) is the reference for all of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from shared.launch import control
from shared.launch.control import CONTROL_PREFIX
from shared.launch.plan import LaunchOptions
from tests.leftovers import processes_naming, short_folder, streaming_segments_naming
from tests.train.checkpoints.test_resume_ranks import assert_same_weights
from tests.train.conftest import REPO_ROOT, tiny_overrides
from train.checkpoints.files import LATEST_NAME, read_checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.slow]

MAX_BATCHES = 12  # 8 batches of 8 an epoch on the 64-row tiny dataset: the run crosses an epoch
SETTINGS = [
    "samples.enabled=false",
    "save_interval=4ba",
    "ema.smoothing=0.9",
    f"max_duration={MAX_BATCHES}ba",
]
WEIGHT_ATOL = 1e-6  # same ranks, same samples: resumed runs match to float noise (issue 15's bound)
RUN_TIMEOUT_S = 400
HANG_TIMEOUT_S = 20  # a tiny step takes well under a second even on a loaded 2-core machine


def launch_argv(save: Path, *extra: str) -> list[str]:
    overrides = tiny_overrides(DATA["root"], save, save.parent / f"cache-{save.name}", *SETTINGS, *extra)
    return [sys.executable, "-m", "train", "launch", "--config", "tiny", "--gpus", "2", *overrides]


DATA: dict[str, str] = {}


def env_for(tmp: Path, **extra: str) -> dict[str, str]:
    """Single-threaded torch (results match across processes); the supervisor's control folder under `tmp`."""
    (tmp / "ctl").mkdir(exist_ok=True)
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(tmp / "ctl"),
        **extra,
    }


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:
        return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[bytes], log: Path) -> int:
    try:
        return proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(log.read_text()[-6000:]) from None


def heartbeats(tmp: Path) -> list[control.Heartbeat]:
    beats = []
    for folder in (tmp / "ctl").glob(f"{CONTROL_PREFIX}*"):
        beats += control.read_heartbeats(folder)
    return beats


def wait_for_batch(tmp: Path, rank: int, batch: int, proc: subprocess.Popen[bytes], log: Path) -> int:
    """The pid of `rank` once it has completed `batch` steps."""
    deadline = time.time() + RUN_TIMEOUT_S
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()[-6000:]
        for beat in heartbeats(tmp):
            if beat.rank == rank and beat.batch >= batch:
                return beat.pid
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never reached batch {batch}: {log.read_text()[-4000:]}")


def final_state(save: Path) -> dict[str, Any]:
    return read_checkpoint(save / LATEST_NAME)["state"]


def assert_matches_reference(reference: Path, save: Path) -> None:
    assert saved_batches(save)[-1] == MAX_BATCHES
    assert_same_weights(final_state(save), final_state(reference), WEIGHT_ATOL)


def assert_nothing_left(text: str, tmp: Path) -> None:
    """No Streaming segment of this run's folders in /dev/shm, no resource_tracker warning (issue 34), no
    process of the run still running (its environment names `tmp`)."""
    assert "leaked shared_memory" not in text and "resource_tracker" not in text, text[-3000:]
    assert streaming_segments_naming([tmp.resolve()]) == []
    assert processes_naming(tmp.resolve()) == []


def assert_clean_stop(text: str, tmp: Path) -> None:
    """A resumable stop through `train launch`: no Python traceback from the ranks, torchrun or the launcher
    and nothing left behind."""
    assert "Traceback" not in text and "ResumableStop" not in text, text[-4000:]
    assert_nothing_left(text, tmp)


def saved_batches(save: Path) -> list[int]:
    return sorted(int(p.name.split("-ba")[1].split("-")[0]) for p in save.glob("ep*-ba*-rank0.pt"))


@pytest.fixture(scope="module")
def reference(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank run every test compares with."""
    DATA["root"] = tiny_dataset
    tmp = tmp_path_factory.mktemp("unattended-reference")
    save, log = tmp / "save", tmp / "run.log"
    assert finish(start(launch_argv(save), env_for(tmp), log), log) == 0, log.read_text()[-4000:]
    return save


@pytest.mark.parametrize("to", ["the launch command", "every process of the job"])
def test_sigterm_to_the_launch_command_saves_exits_resumable_and_the_rerun_matches(
    reference: Path, tmp_path: Path, to: str
) -> None:
    """Also to every process of the job with 2 loader workers a rank, as the shipped recipes read: Slurm
    signals every process of a job step at a preemption, a scancel or the time limit."""
    save, log = tmp_path / "save", tmp_path / "run.log"
    whole_job = to == "every process of the job"
    workers = ["data.num_workers=2"] if whole_job else []
    with short_folder("sdu-") as tmp:  # loader workers hand batches over through Unix sockets in TMPDIR
        proc = start(launch_argv(save, *workers), env_for(tmp), log)
        wait_for_batch(tmp, 0, 5, proc, log)
        # slurmstepd signals every process of the step's cgroup, whatever its session (the supervisor starts
        # torchrun in a session of its own): the launcher, the supervisor, torchrun, the ranks, their workers.
        for pid in processes_naming(tmp.resolve()) if whole_job else [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        assert finish(proc, log) == control.EXIT_RESUMABLE, log.read_text()[-4000:]
        stopped = saved_batches(save)[-1]
        assert 5 <= stopped < MAX_BATCHES, (stopped, log.read_text()[-3000:])  # the current step, not batch 4
        assert "rerun the same command to resume" in log.read_text()
        assert_clean_stop(log.read_text(), tmp)
        assert finish(start(launch_argv(save), env_for(tmp), log), log) == 0, log.read_text()[-4000:]
    assert f"ba{stopped}" in log.read_text().split("autoresume: continuing from")[-1].splitlines()[0]
    assert_matches_reference(reference, save)


def test_max_wall_time_saves_and_exits_resumable_and_clock_saves_keep_the_weights(
    reference: Path, tmp_path: Path
) -> None:
    """resilience.max_wall_time through `train launch`: a limit already past when the first step ends saves
    that step and exits 75. The rerun saves on the clock (save_interval_minutes) at steps the batch interval
    (4) would not, and still ends on the reference's weights."""
    save, log = tmp_path / "save", tmp_path / "run.log"
    limited = launch_argv(save, "resilience.max_wall_time=1s", "resilience.exit_lead_s=0")
    assert finish(start(limited, env_for(tmp_path), log), log) == control.EXIT_RESUMABLE, log.read_text()[
        -4000:
    ]
    stopped = saved_batches(save)[-1]
    assert stopped < 4, (stopped, log.read_text()[-3000:])  # before the first batch-interval save
    assert "saving and stopping (the deadline)" in log.read_text()
    assert_clean_stop(log.read_text(), tmp_path)
    clocked = launch_argv(save, "save_interval_minutes=0.0001")  # every 6 ms: at (almost) every step
    assert finish(start(clocked, env_for(tmp_path), log), log) == 0, log.read_text()[-4000:]
    kept = saved_batches(save)  # the last 3 (save_num_checkpoints_to_keep)
    assert kept[-1] == MAX_BATCHES and any(batch % 4 for batch in kept), (
        kept
    )  # saves between the 4-batch ones
    assert_matches_reference(reference, save)


def test_kill_9_of_one_rank_restarts_by_itself_and_matches(reference: Path, tmp_path: Path) -> None:
    save, log = tmp_path / "save", tmp_path / "run.log"
    proc = start(launch_argv(save), env_for(tmp_path), log)
    os.kill(wait_for_batch(tmp_path, 1, 5, proc, log), signal.SIGKILL)
    assert finish(proc, log) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "restart 1/3 from the checkpoint of step 4" in text
    assert "Traceback" not in text  # the rank left behind says its peer died in one line, if at all
    assert_matches_reference(reference, save)
    assert_nothing_left(text, tmp_path)  # the restart removed the killed attempt's segments


def test_kill_9_of_the_launch_command_leaves_no_process_training_on(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """The supervisor runs torchrun in a session of its own, so a kill -9 of it (or the OOM killer) left
    torchrun and both ranks training on, unsupervised, parented to init: torchrun now dies with the
    supervisor, and each rank with torchrun."""
    from train.data.shm import unlink_shm

    DATA["root"] = tiny_dataset
    save, log = tmp_path / "save", tmp_path / "run.log"
    with short_folder("sdk-") as tmp:  # what the SIGKILLed processes would have removed stays in here
        proc = start(launch_argv(save, "max_duration=4000ba"), env_for(tmp), log)
        try:
            wait_for_batch(tmp, 1, 2, proc, log)
            proc.kill()
            proc.wait()
            deadline = time.monotonic() + 30
            while (left := processes_naming(tmp.resolve())) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert left == [], log.read_text()[-3000:]
        finally:
            for pid in processes_naming(tmp.resolve()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    for name in streaming_segments_naming([tmp_path.resolve()]):  # the SIGKILLed ranks' (no restart here)
        unlink_shm(name)


def test_a_stopped_rank_is_declared_hung_its_stack_logged_and_the_job_restarts(
    reference: Path, tmp_path: Path
) -> None:
    save, log = tmp_path / "save", tmp_path / "run.log"
    proc = start(launch_argv(save, f"resilience.hang_timeout_s={HANG_TIMEOUT_S}"), env_for(tmp_path), log)
    stopped = wait_for_batch(tmp_path, 1, 5, proc, log)
    os.kill(stopped, signal.SIGSTOP)
    assert finish(proc, log) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "hung (no step for" in text and f"--- rank 1 (pid {stopped}) ---" in text
    stack = text.split(f"--- rank 1 (pid {stopped}) ---")[1][:3000]
    assert "Thread" in stack or "State:" in stack  # py-spy's dump, or the /proc fallback
    assert "restart 1/3" in text
    assert_matches_reference(reference, save)


def test_a_failure_at_the_same_step_stops_after_one_restart_and_the_fixed_rerun_matches(
    reference: Path, tmp_path: Path
) -> None:
    save, log = tmp_path / "save", tmp_path / "run.log"
    drill = env_for(tmp_path, SD_FAULT_DRILL="1:6")
    assert finish(start(launch_argv(save), drill, log), log) == control.EXIT_GAVE_UP
    text = log.read_text()
    assert text.count("restart 1/3") == 1 and "restart 2/3" not in text
    assert "again at step 6" in text and "the checkpoint of step 4" in text
    assert finish(start(launch_argv(save), env_for(tmp_path), log), log) == 0, log.read_text()[-4000:]
    assert_matches_reference(reference, save)


# ------------------------------------------------------------------------------------------------ Slurm
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SCONTROL = """#!/bin/bash
echo "$*" >> "$STUBS/calls"
case "$1 $2" in
  "show hostnames") echo 127.0.0.1 ;;
  "show job") echo "JobId=$SLURM_JOB_ID JobState=RUNNING EndTime=$(cat "$STUBS/end_time")" ;;
esac
"""
# One node: srun's options dropped, the task run here with its node id (srun forwards signals to it).
SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
"""


def slurm_script(save: Path) -> str:
    from train.launch import plan_train

    options = LaunchOptions(2, "slurm", gpus_per_node=2, master_port=free_port())
    overrides = tiny_overrides(DATA["root"], save, save.parent / f"cache-{save.name}", *SETTINGS)
    plan = plan_train("tiny", overrides, options)
    assert plan.steps[0].stdin is not None
    return plan.steps[0].stdin


def segment(
    script: str, tmp: Path, log: Path, restart_count: int, end_in_s: float
) -> subprocess.Popen[bytes]:
    stubs = tmp / "stubs"
    stubs.mkdir(exist_ok=True)
    for name, body in (("scontrol", SCONTROL), ("srun", SRUN)):
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    (stubs / "end_time").write_text(
        datetime.fromtimestamp(time.time() + end_in_s).strftime("%Y-%m-%dT%H:%M:%S")
    )
    slurm = {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n1", "SLURM_CPUS_ON_NODE": "2",
        "SLURM_RESTART_COUNT": str(restart_count), "STUBS": str(stubs),
    }  # fmt: skip
    env = env_for(tmp, **slurm)
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    with log.open("ab") as handle:
        return subprocess.Popen(
            ["bash", "-c", script], cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT
        )


def test_slurm_script_saves_on_signal_and_deadline_requeues_itself_and_matches(
    reference: Path, tmp_path: Path
) -> None:
    save, log = tmp_path / "save", tmp_path / "slurm.out"
    script = slurm_script(save)
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:USR1@" in script
    calls = tmp_path / "stubs" / "calls"
    # Segment 0: the batch shell gets the warning signal mid-run.
    shell = segment(script, tmp_path, log, 0, end_in_s=86_400)
    wait_for_batch(tmp_path, 0, 3, shell, log)
    shell.send_signal(signal.SIGUSR1)
    assert finish(shell, log) == 0, log.read_text()[-4000:]
    assert "requeue 4242" in calls.read_text() and "requeueing job 4242 as segment 1" in log.read_text()
    first_stop = saved_batches(save)[-1]
    assert 3 <= first_stop < MAX_BATCHES
    # Segment 1: EndTime is already within the lead: the ranks save after one step and requeue.
    shell = segment(script, tmp_path, log, 1, end_in_s=10)
    assert finish(shell, log) == 0, log.read_text()[-4000:]
    assert calls.read_text().count("requeue 4242") == 2
    assert saved_batches(save)[-1] == first_stop + 1
    assert "on the deadline" in log.read_text()
    # Segment 2: enough time left: the run finishes.
    shell = segment(script, tmp_path, log, 2, end_in_s=86_400)
    assert finish(shell, log) == 0, log.read_text()[-4000:]
    assert calls.read_text().count("requeue 4242") == 2
    assert_matches_reference(reference, save)
