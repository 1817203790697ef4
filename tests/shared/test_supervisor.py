"""The supervisor's decisions with real child processes (bash scripts speaking the control-folder protocol
of shared/launch/control.py): restart budget, crash loops, fatal errors, hangs and stop signals. The same
paths with real training ranks: tests/train/resilience/test_unattended.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from shared.launch import control
from shared.launch.deadline import parse_end_time
from shared.launch.supervisor import Supervision, Supervisor, alive, descendants

FAST = {"poll_s": 0.05}


def script(tmp_path: Path, body: str) -> list[str]:
    """A child that counts its attempts in tmp_path/attempts, then runs `body` (bash)."""
    path = tmp_path / "child.sh"
    head = 'n=$(( $(cat "$T/attempts" 2>/dev/null || echo 0) + 1 )); echo $n > "$T/attempts"\n'
    path.write_text("#!/bin/bash\n" + head + textwrap.dedent(body))
    path.chmod(0o755)
    return [str(path)]


def run(tmp_path: Path, body: str, **supervision: float) -> tuple[int, list[str]]:
    lines: list[str] = []
    env = {**os.environ, "T": str(tmp_path)}
    argv = script(tmp_path, body)
    code = Supervisor(argv, Supervision(**{**FAST, **supervision}), env=env, log=lines.append).run()
    return code, lines


def run_stopped(tmp_path: Path, body: str, **supervision: float) -> tuple[int, list[str]]:
    """`run`, with a SIGTERM to this process (the supervisor's) a second in; the body waits for the stop
    file the supervisor then writes."""
    waits = 'echo "1 $$" > "$SD_CONTROL_DIR/heartbeat-rank0"\n'
    waits += 'until [ -e "$SD_CONTROL_DIR/stop" ]; do sleep 0.05; done\n'
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        return run(tmp_path, waits + textwrap.dedent(body), **supervision)
    finally:
        timer.cancel()


def attempts(tmp_path: Path) -> int:
    return int((tmp_path / "attempts").read_text())


def test_a_crash_at_a_new_step_each_time_restarts_until_the_budget(tmp_path: Path) -> None:
    # Each attempt gets one step further (heartbeat batch = attempt number), then dies like a killed rank.
    body = 'echo "$n $$" > "$SD_CONTROL_DIR/heartbeat-rank0"; kill -9 $$\n'
    code, lines = run(tmp_path, body, max_restarts=2)
    assert code == control.EXIT_GAVE_UP
    assert attempts(tmp_path) == 3  # the first run and 2 restarts
    assert "restart 2/2" in "\n".join(lines) and "the budget" in lines[-1]


def test_the_same_failure_at_the_same_step_stops_without_spending_the_budget(tmp_path: Path) -> None:
    body = 'echo "6 $$" > "$SD_CONTROL_DIR/heartbeat-rank0"\n'
    body += 'progress=\'{"saved_batch": 4, "checkpoint": "ep0-ba4"}\'\n'
    body += 'echo "$progress" > "$SD_CONTROL_DIR/progress.json"; exit 1\n'
    code, lines = run(tmp_path, body, max_restarts=5)
    assert code == control.EXIT_GAVE_UP
    assert attempts(tmp_path) == 2
    assert "again at step 6" in lines[-1] and "the checkpoint of step 4 (ep0-ba4)" in lines[-1]


def test_a_fatal_error_stops_at_once_with_its_message(tmp_path: Path) -> None:
    body = """echo '{"state": "fatal", "batch": -1, "message": "ConfigError: data.uri is empty"}' \\
        > "$SD_CONTROL_DIR/exit.json"; exit 1\n"""
    code, lines = run(tmp_path, body, max_restarts=3)
    assert code == control.EXIT_FATAL
    assert attempts(tmp_path) == 1 and "data.uri is empty" in lines[-1]


FINISHED = """echo '{"state": "finished", "batch": -1, "message": "RunFinishedError: already reached"}' \\
    > "$SD_CONTROL_DIR/exit.json"; exit 1
"""


def test_a_crash_after_the_final_save_ends_done_not_fatal(tmp_path: Path) -> None:
    """Attempt 1 dies at teardown, after the last checkpoint and its `latest`; the restarted ranks find the
    run finished. The run is complete: exit 0, not 'a restart cannot fix this' (2)."""
    body = 'echo "12 $$" > "$SD_CONTROL_DIR/heartbeat-rank0"\nif [ $n -eq 1 ]; then kill -9 $$; fi\n'
    code, lines = run(tmp_path, body + FINISHED, max_restarts=3)
    assert code == control.EXIT_DONE and attempts(tmp_path) == 2
    assert "the run had finished before the crash" in lines[-1]


def test_a_rerun_of_a_finished_run_is_still_an_error(tmp_path: Path) -> None:
    code, lines = run(tmp_path, FINISHED, max_restarts=3)
    assert code == control.EXIT_FATAL and attempts(tmp_path) == 1
    assert "already reached" in lines[-1]


def test_a_fatal_error_during_a_stop_signal_is_fatal_not_resumable(tmp_path: Path) -> None:
    """75 would have Slurm requeue a config or data error up to max_requeues times."""
    body = """echo '{"state": "fatal", "batch": -1, "message": "DataError: shard 3 is corrupt"}' \\
        > "$SD_CONTROL_DIR/exit.json"; exit 1\n"""
    code, lines = run_stopped(tmp_path, body, max_restarts=3)
    assert code == control.EXIT_FATAL and "shard 3 is corrupt" in lines[-1]


def test_ranks_killed_during_a_stop_say_the_run_stopped_and_how_they_ended(tmp_path: Path) -> None:
    code, lines = run_stopped(tmp_path, "kill -9 $$\n", max_restarts=3)
    assert code == control.EXIT_RESUMABLE
    assert lines[-1] == "stopped on SIGTERM (torchrun exited -9); rerun the same command to resume"


def test_a_stale_heartbeat_is_a_hang_the_processes_are_killed_and_restarted(tmp_path: Path) -> None:
    # Attempt 1 writes one heartbeat then stops itself (SIGSTOP: it cannot answer any signal); attempt 2 ends.
    body = """if [ $n -eq 1 ]; then echo "3 $$" > "$SD_CONTROL_DIR/heartbeat-rank0"; kill -STOP $$; fi
    exit 0
    """
    code, lines = run(tmp_path, body, max_restarts=1, hang_timeout_s=1)
    assert code == control.EXIT_DONE and attempts(tmp_path) == 2
    text = "\n".join(lines)
    assert "rank(s) [0] hung" in text and "--- rank 0 (pid" in text
    assert "restart 1/1" in text


OUTAGE = """echo '{"state": "outage", "batch": -1, "message": "StorageError: S3 did not answer"}' \\
    > "$SD_CONTROL_DIR/exit.json"; exit 1
"""


def test_an_s3_outage_restarts_without_counting_as_a_crash(tmp_path: Path) -> None:
    """Attempt 1 fails at step 6 on an outage, attempt 2 crashes at the same step, attempt 3 ends. Counted as
    crashes, the second failure at step 6 would have stopped the launch (a crash loop)."""
    body = 'echo "6 $$" > "$SD_CONTROL_DIR/heartbeat-rank0"\n'
    body += "if [ $n -eq 1 ]; then " + OUTAGE.replace("\n", " ").strip() + "; fi\n"
    body += "if [ $n -eq 2 ]; then exit 1; fi\nexit 0\n"
    code, lines = run(tmp_path, body, max_restarts=1)
    assert code == control.EXIT_DONE and attempts(tmp_path) == 3, lines
    text = "\n".join(lines)
    assert "S3 outage at step 6 (StorageError: S3 did not answer)" in text and "not counted" in text
    assert "restart 1/1" in text


def test_outages_again_at_the_same_step_count_as_crashes(tmp_path: Path) -> None:
    body = 'echo "6 $$" > "$SD_CONTROL_DIR/heartbeat-rank0"\n' + OUTAGE
    code, lines = run(tmp_path, body, max_restarts=3)
    assert code == control.EXIT_GAVE_UP and attempts(tmp_path) == 3, lines
    assert "again at step 6" in lines[-1]


def test_a_rank_that_never_exits_after_training_is_a_closing_hang(tmp_path: Path) -> None:
    """Attempt 1 finishes training and then hangs in its teardown (a process group's destroy that never
    returns): it was never watched, and held the job until the scheduler's time limit. Killed after
    hang_timeout_s; the restart finds the run finished: done."""
    body = """if [ $n -eq 1 ]; then echo "12 $$ 0 finished" > "$SD_CONTROL_DIR/heartbeat-rank0"; sleep 600; fi
    """
    code, lines = run(tmp_path, body + FINISHED, max_restarts=1, hang_timeout_s=1)
    assert code == control.EXIT_DONE and attempts(tmp_path) == 2, lines
    text = "\n".join(lines)
    assert "rank(s) [0] did not exit after training ended for 1 s" in text
    assert "the run had finished before the crash" in lines[-1]


def test_a_finished_rank_whose_process_is_gone_is_no_hang(tmp_path: Path) -> None:
    """Rank 0 finished and exited while another rank still uploads (here: the attempt itself goes on)."""
    body = """(echo "12 $BASHPID 0 finished" > "$SD_CONTROL_DIR/heartbeat-rank0"); sleep 2.5; exit 0
    """
    code, lines = run(tmp_path, body, max_restarts=1, hang_timeout_s=1)
    assert code == control.EXIT_DONE and attempts(tmp_path) == 1, lines


def test_the_resume_point_of_an_s3_save_folder_is_the_last_save_that_arrived(tmp_path: Path) -> None:
    """Step 8's checkpoint was still uploading when the rank died: a restart resumes from step 4's (the
    supervisor had named step 8's, which never reached S3)."""
    progress = {
        "saved_batch": 8, "checkpoint": "s3://b/run/ep0-ba8-rank0.pt",
        "uploaded_batch": 4, "uploaded_checkpoint": "s3://b/run/ep0-ba4-rank0.pt",
    }  # fmt: skip
    body = f"echo '{json.dumps(progress)}' > \"$SD_CONTROL_DIR/progress.json\"\n"
    body += 'echo "9 $$" > "$SD_CONTROL_DIR/heartbeat-rank0"\nexit 1\n'
    code, lines = run(tmp_path, body, max_restarts=1)
    assert code == control.EXIT_GAVE_UP
    assert (
        "from the checkpoint of step 4 (s3://b/run/ep0-ba4-rank0.pt; step 8's was still uploading)"
        in lines[0]
    ), lines
    progress.pop("uploaded_batch")
    progress.pop("uploaded_checkpoint")
    body = f"echo '{json.dumps(progress)}' > \"$SD_CONTROL_DIR/progress.json\"\nexit 1\n"
    (tmp_path / "attempts").unlink()
    code, lines = run(tmp_path, body, max_restarts=1)
    assert "from the latest checkpoint in save_folder (step 8's was still uploading)" in lines[0], lines


def test_elastic_an_unreachable_rendezvous_is_named_not_taken_for_spent_restarts(tmp_path: Path) -> None:
    lines: list[str] = []
    argv = [*script(tmp_path, "exit 3\n"), "--rdzv-endpoint=node0.example:29400"]
    env = {**os.environ, "T": str(tmp_path)}
    code = Supervisor(argv, Supervision(elastic=True, **FAST), env=env, log=lines.append).run()
    assert code == control.EXIT_GAVE_UP
    assert "could not reach the rendezvous store (node0.example:29400, node 0's agent" in lines[-1], lines
    assert "restarts" not in lines[-1].split("):", 1)[1]


def test_sigterm_asks_the_ranks_to_stop_and_exits_resumable(tmp_path: Path) -> None:
    # The child plays a rank: waits for the stop file, records a resumable exit, exits.
    body = """echo '{"state": "resumable", "batch": 1, "message": "saved"}' > "$SD_CONTROL_DIR/exit.json"
    exit 75
    """
    code, lines = run_stopped(tmp_path, body, max_restarts=3)
    assert code == control.EXIT_RESUMABLE and attempts(tmp_path) == 1
    assert any("SIGTERM" in line for line in lines)


def test_semaphores_of_a_rank_killed_with_its_resource_tracker_are_removed_when_the_run_ends(
    tmp_path: Path,
) -> None:
    """A rank killed with its process group (as torchrun's agent stops one) takes Python's resource tracker
    along, so its named semaphores stay in /dev/shm; the supervisor removes them when the run ends, even if
    no poll saw them mapped (the rank is gone before the first poll). One a live process holds stays."""
    import multiprocessing

    rank = (
        "import multiprocessing as mp, os, signal; lock = mp.get_context('spawn').Lock(); "
        "print(lock._semlock.name, flush=True); os.killpg(0, signal.SIGKILL)"
    )
    body = f'setsid "{sys.executable}" -c "{rank}" > "$T/sem-name"; exit 0\n'
    held = multiprocessing.get_context("spawn").Lock()  # this process maps it until the test ends
    held_path = Path(f"/dev/shm/sem.{held._semlock.name.lstrip('/')}")  # type: ignore[attr-defined]
    code, lines = run(tmp_path, body, poll_s=2)
    name = (tmp_path / "sem-name").read_text().strip().lstrip("/")
    assert code == control.EXIT_DONE and name.startswith("mp-")
    # Gone; this supervisor says so unless another test's supervisor, ending at the same moment, took it.
    assert not Path(f"/dev/shm/sem.{name}").exists(), lines
    assert held_path.exists()


def test_a_semaphore_another_job_made_during_the_run_stays(tmp_path: Path) -> None:
    """Another job of this user (started by the rank, in a session of its own and without the run's
    $SD_CONTROL_DIR, so not one of the run's strays) creates a semaphore during the run and holds it: it is
    mapped only by its creator, under glibc's temporary name, and must survive the sweep at the end
    (matched by inode; by name it was taken)."""
    job = (
        "import multiprocessing as mp, time; lock = mp.get_context('spawn').Lock(); "
        "print(lock._semlock.name, flush=True); time.sleep(60)"
    )
    other_job = f'env -u SD_CONTROL_DIR setsid "{sys.executable}" -c "{job}"'
    body = f'{other_job} > "$T/sem-name" & echo $! > "$T/job-pid"\n'
    body += 'until [ -s "$T/sem-name" ]; do sleep 0.05; done; exit 0\n'
    code, lines = run(tmp_path, body)
    try:
        name = (tmp_path / "sem-name").read_text().strip().lstrip("/")
        assert code == control.EXIT_DONE and name.startswith("mp-")
        assert Path(f"/dev/shm/sem.{name}").exists(), lines
    finally:
        os.kill(int((tmp_path / "job-pid").read_text()), signal.SIGKILL)


def test_what_a_killed_rank_left_running_outside_the_tree_is_ended(tmp_path: Path) -> None:
    """A rank's child outlives the rank (reparented to init, as when a rank is kill -9'd from outside):
    the supervisor ends it, found by the control folder in its environment; an unrelated process stays."""
    unrelated = subprocess.Popen(["sleep", "60"])
    body = 'setsid sleep 60 & echo $! > "$T/stray-pid"; exit 0\n'
    try:
        code, lines = run(tmp_path, body)
        stray = int((tmp_path / "stray-pid").read_text())
        deadline = time.time() + 10
        while alive(stray) and time.time() < deadline:
            time.sleep(0.05)
        assert code == control.EXIT_DONE and not alive(stray), lines
        assert any(
            f"ended 1 process(es) killed ranks had left running (pids [{stray}])" in line for line in lines
        )
        assert unrelated.poll() is None
    finally:
        unrelated.kill()
        unrelated.wait()
        with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):
            os.kill(int((tmp_path / "stray-pid").read_text()), signal.SIGKILL)


def test_descendants_finds_grandchildren_in_new_sessions() -> None:
    code = (
        "import subprocess, time; subprocess.Popen(['sleep', '30'], start_new_session=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 20
        while len(descendants(child.pid)) < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert len(descendants(child.pid)) == 1
    finally:
        for pid in [*descendants(child.pid), child.pid]:
            os.kill(pid, signal.SIGKILL)
        child.wait()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("JobId=7 EndTime=2026-11-25T18:00:00 Deadline=N/A", "2026-11-25T18:00:00"), ("EndTime=Unknown", None)],
)
def test_slurm_end_time_is_read_from_scontrol(text: str, expected: str | None) -> None:
    from datetime import datetime

    want = None if expected is None else datetime.fromisoformat(expected).timestamp()
    assert parse_end_time(text) == want


def test_max_wall_time_becomes_the_ranks_deadline_less_the_lead(tmp_path: Path) -> None:
    body = 'echo "$SD_DEADLINE" > "$T/deadline"\n'
    before = time.time()
    code, _ = run(tmp_path, body, max_wall_time_s=100, deadline_lead_s=10)
    assert code == control.EXIT_DONE
    deadline = float((tmp_path / "deadline").read_text())  # written to the millisecond
    assert before + 90 - 0.001 <= deadline <= time.time() + 90


# ---------------------------------------------------- several nodes: torchrun's elastic agent restarts
def elastic_run(tmp_path: Path, generations: list[str], **supervision: float) -> tuple[int, list[str], float]:
    """A fake torchrun that runs one "rank" per generation in turn (as its elastic agent restarts the worker
    group), then exits 0; the supervisor watches it with `elastic`."""
    ranks = "".join(f"bash -c {shlex_quote(body)}\n" for body in generations)
    lines: list[str] = []
    env = {**os.environ, "T": str(tmp_path)}
    argv = script(tmp_path, ranks + "exit 0\n")
    start = time.monotonic()
    settings = Supervision(**{**FAST, **supervision}, elastic=True)  # type: ignore[arg-type]
    code = Supervisor(argv, settings, env=env, log=lines.append).run()
    return code, lines, time.monotonic() - start


def shlex_quote(text: str) -> str:
    import shlex

    return shlex.quote(textwrap.dedent(text))


def beat(batch: int, then: str) -> str:
    return f'echo "{batch} $$" > "$SD_CONTROL_DIR/heartbeat-rank1"; {then}'


def test_elastic_a_rank_restarted_by_torchrun_is_logged_and_the_run_finishes(tmp_path: Path) -> None:
    code, lines, _ = elastic_run(tmp_path, [beat(5, "sleep 0.5; kill -9 $$"), beat(8, "sleep 0.5")])
    assert code == control.EXIT_DONE, lines
    assert attempts(tmp_path) == 1  # the supervisor never restarted torchrun itself
    assert any(
        "crash at step 5: torchrun restarted every node's ranks, restart 1/3" in line for line in lines
    )


def test_elastic_the_same_step_twice_stops_every_node(tmp_path: Path) -> None:
    dies = beat(5, "sleep 0.5; kill -9 $$")
    code, lines, took = elastic_run(tmp_path, [dies, dies, beat(5, "sleep 60")], max_restarts=5)
    assert code == control.EXIT_GAVE_UP, lines
    # (not always the last line: a /dev/shm sweep may follow, of orphans another test's ranks left)
    assert any("again at step 5" in line and "stopping every node" in line for line in lines), lines
    assert took < 30  # torchrun (and its third generation) was stopped, not waited for


def test_elastic_a_stopped_rank_is_named_and_killed_so_torchrun_restarts_it(tmp_path: Path) -> None:
    code, lines, _ = elastic_run(tmp_path, [beat(3, "kill -STOP $$"), beat(6, "sleep 0.5")], hang_timeout_s=1)
    assert code == control.EXIT_DONE, lines
    text = "\n".join(lines)
    assert "is stopped (SIGSTOP" in text and "--- rank 1 (pid" in text
    assert "hang at step 3: torchrun restarted every node's ranks, restart 1/3" in text


def test_elastic_ranks_that_saved_on_a_stop_exit_0_and_the_supervisor_exits_resumable(tmp_path: Path) -> None:
    record = '{"state": "resumable", "batch": 4, "message": "stopped at batch 4"}'
    body = beat(4, f"echo '{record}' > \"$SD_CONTROL_DIR/exit.json\"; exit 0")
    code, lines, _ = elastic_run(tmp_path, [body])
    assert code == control.EXIT_RESUMABLE and "stopped at batch 4" in lines[-1]


def test_supervise_cli_reads_the_flags_the_specs_write(monkeypatch) -> None:
    from shared.launch import supervise

    seen: list[tuple[list[str], Supervision]] = []

    class Recording:
        def __init__(self, command: list[str], supervision: Supervision, deadline: float | None = None):
            seen.append((command, supervision))

        def run(self) -> int:
            return 75

    monkeypatch.setattr(supervise, "Supervisor", Recording)
    settings = Supervision(
        max_restarts=2, hang_timeout_s=30, max_wall_time_s=600, deadline_lead_s=40, elastic=True
    )
    assert supervise.main([*settings.flags(), "--", "torchrun", "--nnodes=2", "-m", "train"]) == 75
    assert seen == [(["torchrun", "--nnodes=2", "-m", "train"], settings)]
    assert supervise.main(["--max-restarts=2"]) == 2  # no command: a usage error


def test_a_heartbeat_whose_pid_another_process_took_is_no_rank(tmp_path: Path) -> None:
    """pid_max is 32768 on a 2-core machine: a dead rank's pid is soon another process's. Its heartbeat (old,
    at the step its generation reached) then read as a live rank that had not stepped: a false hang, which
    killed the healthy next generation and, at the same step again, passed for a crash loop."""
    control.write_heartbeat(tmp_path, 0, 9)
    started = control.process_start(os.getpid())
    assert started and (tmp_path / "heartbeat-rank0").read_text() == f"9 {os.getpid()} {started}"
    assert [(b.rank, b.batch, b.pid) for b in control.read_heartbeats(tmp_path)] == [(0, 9, os.getpid())]
    (tmp_path / "heartbeat-rank1").write_text(f"9 {os.getpid()} {started + 1}")  # the pid, another process
    (tmp_path / "heartbeat-rank2").write_text(f"4 {os.getpid()} {started} finished")
    (tmp_path / "heartbeat-rank3").write_text(f"7 {os.getpid()}")  # no start: taken as written
    beats = control.read_heartbeats(tmp_path)
    assert [(b.rank, b.batch, b.finished) for b in beats] == [(0, 9, False), (2, 4, True), (3, 7, False)]


def test_a_gone_supervisors_control_folder_is_removed_by_the_next(tmp_path: Path) -> None:
    """A node lost whole and rerun in place: the dead supervisor's control folder, with the ranks' scratch
    TMPDIR and Composer's staged checkpoint copies in it (two of 14 GB for SD2-base), stayed for good."""
    from shared.launch.control import CONTROL_PREFIX, remove_dead_control_folders

    gone = subprocess.Popen(
        [sys.executable, "-c", "import pathlib, sys; from shared.launch import control; "
         "d = pathlib.Path(sys.argv[1]); d.mkdir(); control.write_owner(d); (d / 'tmp').mkdir()",
         str(tmp_path / f"{CONTROL_PREFIX}gone")], cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert gone.wait(timeout=60) == 0
    live = tmp_path / f"{CONTROL_PREFIX}live"
    live.mkdir()
    control.write_owner(live)  # this process: alive
    unknown = tmp_path / f"{CONTROL_PREFIX}unknown"
    unknown.mkdir()  # no owner record: left alone
    assert remove_dead_control_folders(tmp_path) == 1
    assert not (tmp_path / f"{CONTROL_PREFIX}gone").exists() and live.exists() and unknown.exists()
