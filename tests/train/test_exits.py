"""Expected stops end in a line or two and their exit code; bugs keep their traceback; --debug shows all."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from shared.config import ConfigError
from shared.runtime.exits import (
    DEBUG_ENV,
    Stop,
    add_debug_option,
    guard_commands,
    take_debug_flag,
    torchrun_argv,
)
from shared.storage import StorageError
from tests.train.conftest import REPO_ROOT
from train.cli import classify
from train.resilience.exits import ResumableStop


def _app(error: Exception) -> typer.Typer:
    app = typer.Typer()
    add_debug_option(app)

    @app.command()
    def go() -> None:
        raise error

    @app.command()
    def fine() -> None:
        typer.echo("ok")

    guard_commands(app, classify)
    return app


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off for each test, and whatever a test sets (take_debug_flag writes os.environ) is undone after it:
    a leaked SD_DEBUG=1 would give later tests' subprocesses tracebacks."""
    monkeypatch.setenv(DEBUG_ENV, "0")


def test_a_resumable_stop_is_one_line_with_exit_75() -> None:
    result = CliRunner().invoke(_app(ResumableStop(241, "SIGTERM", "/ck/ep0-ba241-rank0.pt")), ["go"])
    assert result.exit_code == 75
    assert result.output.strip().splitlines() == [
        "stopped at batch 241 on SIGTERM after saving a checkpoint of it (/ck/ep0-ba241-rank0.pt); "
        "rerun the same command to resume (exit code 75)"
    ]
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_user_error_is_one_line_with_exit_2_and_a_bug_keeps_its_traceback() -> None:
    user = CliRunner().invoke(_app(ConfigError("command line: optimizer.lr must be > 0, got -1.0")), ["go"])
    assert user.exit_code == 2
    assert user.output.strip() == "error: command line: optimizer.lr must be > 0, got -1.0"
    bug = CliRunner().invoke(_app(ZeroDivisionError("a real bug")), ["go"])
    assert isinstance(bug.exception, ZeroDivisionError)  # not swallowed: typer prints its traceback


def test_debug_shows_the_traceback_of_an_expected_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(_app(ConfigError("bad")), ["--debug", "go"])
    assert isinstance(result.exception, ConfigError)
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert isinstance(CliRunner().invoke(_app(ConfigError("bad")), ["go"]).exception, ConfigError)


def test_debug_is_taken_from_anywhere_on_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    assert take_debug_flag(["fit", "tiny", "lr=1"]) == ["fit", "tiny", "lr=1"]
    assert os.environ[DEBUG_ENV] == "0"
    assert take_debug_flag(["fit", "tiny", "--debug", "lr=1"]) == ["fit", "tiny", "lr=1"]
    assert os.environ[DEBUG_ENV] == "1"  # and torchrun's ranks inherit it


def test_classify_knows_the_expected_stops() -> None:
    assert classify(ResumableStop(1, "SIGTERM", None)) == Stop(75, prefix="")
    assert classify(ConfigError("x")) == Stop(2)
    assert classify(KeyError("x")) is None
    full = classify(OSError(errno.ENOSPC, "No space left on device", "/ckpt/ep0-ba4-rank0.pt"))
    assert full is not None and full.code == 2 and "the disk is full" in str(full.message)
    assert classify(OSError(errno.ECONNRESET, "Connection reset")) is None  # not a path: a bug or a crash
    assert classify(StorageError("S3 request failed: AccessDenied")) == Stop(2)
    outage = classify(StorageError("S3 request failed: Could not connect", transient=True))
    assert (
        outage is not None
        and outage.code == 1
        and "a rerun resumes from the last checkpoint" in str(outage.message)
    )


# Two gloo ranks; rank 1 dies between two all-reduces, as a rank killed by the OOM killer or kill -9 does.
PEER_DIES = """
import os, sys, torch, torch.distributed as dist
from train.resilience.exits import peer_lost
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
dist.all_reduce(torch.ones(4))
if rank == 1:
    os._exit(9)
try:
    dist.all_reduce(torch.ones(4))
except Exception as err:
    print(peer_lost(err))
"""
GLOO = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:{}] {}"


def closing_barrier_error() -> RuntimeError:
    """Composer's closing barrier fails while the step's collective error is handled (a chained error)."""
    try:
        try:
            raise RuntimeError(GLOO.format(525, "Read error [127.0.0.1]:56518: Connection reset by peer"))
        except RuntimeError as step:
            raise RuntimeError(GLOO.format(589, "Connection closed by peer")) from step
    except RuntimeError as barrier:
        return barrier


def test_a_rank_whose_peer_died_says_so_in_one_line_not_a_traceback(tmp_path, monkeypatch) -> None:
    """Each surviving rank of a job that lost one printed two tracebacks (its collective's, then Composer's
    closing barrier's); now one line each, exit 1 as before (torchrun restarts every rank)."""
    env = {**os.environ, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", PEER_DIES, str(tmp_path / "store")]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    ranks = [subprocess.Popen(argv, cwd=REPO_ROOT, env={**env, "RANK": str(r)}, **pipes) for r in (0, 1)]
    out, err = ranks[0].communicate(timeout=120)
    ranks[1].wait(timeout=60)
    assert out.startswith("rank 0: a collective with the other ranks failed ("), out + err
    assert "another rank died or stopped answering" in out and "gloo/transport" not in out

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    error = closing_barrier_error()
    stop = classify(error)
    assert stop is not None and (stop.code, stop.prefix) == (1, "")
    assert stop.message == (
        "rank 3: a collective with the other ranks failed (RuntimeError: Connection closed by peer): "
        "another rank died or stopped answering; its own lines say why (SD_DEBUG=1 shows this rank's "
        "traceback)"
    )
    result = CliRunner().invoke(_app(error), ["go"])
    assert result.exit_code == 1 and result.output.strip() == stop.message
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: no peer to lose; a bug keeps its traceback
    assert classify(error) is None


def test_a_wrong_value_on_the_real_cli_is_one_line_before_any_work(tmp_path) -> None:
    """The issue's example: `make train ARGS='optimizer.lr=-1 ...'` ended in a torch traceback after building
    everything; now one line, exit 2, and with --debug the traceback."""
    argv = [sys.executable, "-m", "train", "fit", "tiny", "optimizer.lr=-1", f"save_folder={tmp_path}"]
    env = {**os.environ, DEBUG_ENV: "0"}
    run = subprocess.run([*argv, "max_duration=2ba"], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == "error: command line: optimizer.lr must be > 0, got -1.0"
    assert not any(tmp_path.iterdir())  # nothing was built
    debug = subprocess.run([*argv, "--debug"], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert debug.returncode != 0 and "Traceback" in debug.stderr + debug.stdout


def test_a_node_without_gpus_in_a_job_of_several_nodes_says_so_before_joining(tmp_path) -> None:
    """device=auto on a node whose GPUs are not seen, in a job of 2 nodes: its ranks would pick gloo while
    the other node's picked NCCL, and the process group would never form. One line, exit 2, before any
    join (MASTER_PORT leads nowhere); device=cpu is how a CPU job on several nodes says it means it."""
    argv = [sys.executable, "-m", "train", "fit", "tiny", "fsdp=false", f"save_folder={tmp_path}"]
    env = {
        **os.environ, DEBUG_ENV: "0", "CUDA_VISIBLE_DEVICES": "", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "RANK": "3", "LOCAL_RANK": "1", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9",
    }  # fmt: skip
    run = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    (line,) = run.stderr.strip().splitlines()
    assert f"device=auto but this node ({socket.gethostname()}) sees no GPU, in a job of 2 nodes" in line
    assert line.endswith("or pass device=cpu for a CPU job on several nodes")
    assert not any(tmp_path.iterdir())


def test_the_supervisor_runs_torchrun_without_its_traceback_box() -> None:
    """torchrun prints a ChildFailedError traceback whenever a rank exits non-zero, also 75 after a clean
    save; the supervisor runs it through shared/runtime/exits.py (what it then prints: the SIGTERM test of
    tests/train/resilience/test_unattended.py)."""
    argv = ["/venv/bin/torchrun", "--standalone", "-m", "train", "fit"]
    assert torchrun_argv(argv) == [
        sys.executable,
        "-m",
        "shared.runtime.exits",
        "--standalone",
        "-m",
        "train",
        "fit",
    ]
    assert torchrun_argv(["bash", "-c", "x"]) == ["bash", "-c", "x"]


def test_a_rendezvous_whose_store_is_unreachable_ends_torchrun_in_one_line() -> None:
    """A node whose rendezvous store is gone (node 0, which hosts it, lost) or never came: torchrun's agent
    raises RendezvousConnectionError; through the wrapper that is one line and exit 3 (RENDEZVOUS_FAILED: the
    supervisor names the unreachable store, not spent restarts), no traceback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    argv = [
        sys.executable, "-m", "shared.runtime.exits", "--nnodes=2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-conf=is_host=false,read_timeout=2", "-m", "train", "fit",
    ]  # fmt: skip
    env = {**os.environ, DEBUG_ENV: "0"}
    run = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr
    # One line: no Python traceback, and none of the agent's C++ connect retries with their C++ stacks.
    [line] = run.stderr.strip().splitlines()
    assert line.startswith("torchrun: the rendezvous failed: ") and "timed out" in line, run.stderr


def test_a_rank_killed_with_minus_9_ends_torchrun_in_one_line(tmp_path) -> None:
    """A rank that dies without saying why (SIGKILL: the fault drill, the OOM killer) is named in one line,
    by its global rank; torchrun exits 1, and nothing of the wrapper's own raises (before, a wrong field of
    torchrun's ProcessFailure printed an AttributeError traceback under every fault drill)."""
    script = tmp_path / "rank.py"
    script.write_text("import os, signal\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), 9)\n")
    argv = [sys.executable, "-m", "shared.runtime.exits", "--standalone", "--nproc-per-node=2", str(script)]
    env = {**os.environ, DEBUG_ENV: "0", "OMP_NUM_THREADS": "1"}  # else torchrun warns it set it
    run = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines() == ["torchrun: rank 1 exited -9"], run.stderr


def test_torchrun_stopped_by_a_signal_says_so_in_one_line() -> None:
    """`make encode GPUS=2` (the local launcher runs torchrun directly) on Ctrl-C or SIGTERM printed
    torchrun's SignalException traceback and exited 1."""
    import signal
    import time

    import psutil

    argv = [sys.executable, "-m", "shared.runtime.exits", "--standalone", "--nproc-per-node=1", "--no-python"]
    proc = subprocess.Popen([*argv, "sleep", "120"], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(c.name() == "sleep" for c in psutil.Process(proc.pid).children(recursive=True)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "torchrun: stopped by SIGTERM" in err and "Traceback" not in err
