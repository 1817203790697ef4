"""Issue 31: two nodes on one machine, for real. Two `python -m train launch` processes (one per "node",
each the node's supervisor over torchrun's elastic agent), `--nnodes=2` with a c10d rendezvous on 127.0.0.1,
2 gloo ranks each, tiny preset. Each node has its own HOME, temp folder (so its own Streaming cache, control
folder and log folder) and its own /dev/shm: a private mount namespace with a tmpfs on /dev/shm, as separate
hosts would have (Streaming names its shared memory per host, so two nodes sharing one /dev/shm collide).
Checkpoints go to the loopback S3 server. One uninterrupted run is the reference; then one run that meets
every failure on two nodes, in two launches of the same command:
- the first launch: kill -9 of a rank on node 1 (every node's ranks restart within collective_timeout_s),
  then SIGTERM to node 0's launcher: every node saves the same step and exits 75;
- the rerun resumes that step, then: SIGSTOP of a rank on node 1 (the watchdog names it, every node
  restarts), and node 1 lost whole (its supervisor, agent and ranks SIGKILLed): node 0 waits in the
  rendezvous, a replacement node 1 (fresh local folders) joins, and the run ends on the reference's weights
  and EMA.
One run rather than one per failure: each launch of two nodes starts 8 Python processes that import
Composer, which is most of this module's time.
After each launch a node leaves nothing in its temp folder or /dev/shm but what the run keeps (run_keeps).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shared import storage
from shared.launch import control
from shared.launch.control import CONTROL_PREFIX
from shared.launch.supervisor import alive, descendants
from tests.leftovers import RUN_KEEPS, private_shm_works, processes_naming, short_folder
from tests.train.checkpoints.test_resume_ranks import assert_same_weights
from tests.train.conftest import REPO_ROOT
from train.checkpoints.files import fetched_checkpoint, find_latest_checkpoint, read_checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.s3]

MAX_BATCHES = 20  # 8 batches of 8 an epoch on the 64-row tiny dataset: into a third epoch
COLLECTIVE_TIMEOUT_S = 120
HANG_TIMEOUT_S = 30  # a tiny step and its save take seconds on a loaded box (uploads run in the background)
SETTINGS = [
    "device=cpu", "global_batch_size=8", "device_microbatch_size=2", "samples.enabled=false",
    "save_interval=4ba", "ema.smoothing=0.9", f"max_duration={MAX_BATCHES}ba", "resilience.max_restarts=10",
    f"resilience.hang_timeout_s={HANG_TIMEOUT_S}", f"resilience.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
]  # fmt: skip
WEIGHT_ATOL = 1e-6
RUN_TIMEOUT_S = 600
# The node's wrapper: a private /dev/shm, the launch, then what the launch left in /dev/shm.
NODE_SHELL = (
    'mount -t tmpfs -o size=1g tmpfs /dev/shm || exit 97; "$@"; rc=$?; '
    'ls -A /dev/shm > "$NODE_DIR/shm-left"; exit $rc'
)


if not private_shm_works():  # evaluated at collection: root (or CAP_SYS_ADMIN) and util-linux are needed
    pytestmark.append(
        pytest.mark.skip(reason="needs `unshare -m` and a tmpfs mount (root): a /dev/shm per node")
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Node:
    """One "node": its own folders, its wrapper process (unshare -> bash -> the launch) and its log."""

    folder: Path
    proc: subprocess.Popen[bytes]

    @property
    def log(self) -> Path:
        return self.folder / "node.log"

    def launcher_pid(self) -> int:
        """`python -m train launch` (the supervisor): the wrapper's child."""
        deadline = time.time() + 30
        while time.time() < deadline:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            if children:
                return int(children[0])
            time.sleep(0.05)
        raise AssertionError("the node's launch never started")

    def beats(self) -> list[control.Heartbeat]:
        found = []
        for folder in (self.folder / "tmp").glob(f"{CONTROL_PREFIX}*"):
            found += control.read_heartbeats(folder)
        return [beat for beat in found if alive(beat.pid)]

    def text(self) -> str:
        return self.log.read_text(errors="replace")


class Job:
    """The two nodes of one training job (same command, same rendezvous port, same S3 save folder)."""

    def __init__(self, base: Path, data: str, save: str, port: int):
        self.base, self.data, self.save, self.port = base, data, save, port
        self.nodes: list[Node] = []

    def start(self, index: int, name: str | None = None) -> Node:
        folder = self.base / (name or f"n{index}")
        for sub in ("home", "tmp"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ, "HOME": str(folder / "home"), "TMPDIR": str(folder / "tmp"),
            "NODE_DIR": str(folder), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        }  # fmt: skip
        launch = [
            sys.executable, "-m", "train", "launch", "--config", "tiny", "--gpus", "4", "--nodes", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(self.port), "--node-rank", str(index),
            f"data.uri={self.data}", f"save_folder={self.save}", *SETTINGS,
        ]  # fmt: skip
        argv = ["unshare", "-m", "--propagation", "private", "bash", "-c", NODE_SHELL, "node", *launch]
        with (folder / "node.log").open("ab") as log:
            proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        node = Node(folder, proc)
        self.nodes.append(node)
        return node

    def start_both(self) -> tuple[Node, Node]:
        return self.start(0), self.start(1)

    def logs(self) -> str:
        return "\n".join(f"===== {n.folder.name}\n{n.text()[-5000:]}" for n in self.nodes)

    def finish(self, *nodes: Node) -> list[int]:
        try:
            return [node.proc.wait(timeout=RUN_TIMEOUT_S) for node in nodes]
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(self.logs()) from None

    def kill_all(self) -> None:
        for node in self.nodes:
            kill_tree(node.proc.pid)

    def wait_for_batch(self, node: Node, batch: int) -> list[control.Heartbeat]:
        """The node's live heartbeats once one of them has completed `batch` steps."""
        deadline = time.time() + RUN_TIMEOUT_S
        while time.time() < deadline:
            assert all(n.proc.poll() is None for n in self.nodes), self.logs()
            beats = node.beats()
            if any(beat.batch >= batch for beat in beats):
                return beats
            time.sleep(0.05)
        raise AssertionError(f"{node.folder.name} never reached batch {batch}: {self.logs()}")


def kill_tree(pid: int) -> None:
    for each in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


def wait_gone(pids: list[int], timeout_s: float) -> None:
    """Until every pid has exited (AssertionError after timeout_s)."""
    start = time.monotonic()
    while any(alive(pid) for pid in pids):
        assert time.monotonic() - start < timeout_s, f"{pids} still running after {timeout_s} s"
        time.sleep(0.05)


def final_state(save: str) -> dict[str, Any]:
    latest = find_latest_checkpoint(save)
    assert latest is not None, f"no checkpoint in {save}"
    with fetched_checkpoint(latest) as path:
        return read_checkpoint(path)["state"]


def saved_batch(save: str) -> int:
    latest = find_latest_checkpoint(save)
    assert latest is not None
    # the file name only: the save folder's random prefix may hold "-ba" too (two-nodes-ba7a41...: CI)
    return int(latest.rsplit("/", 1)[-1].split("-ba")[1].split("-")[0])


def around_traceback(text: str) -> str:
    """What a failure shows: the log around its first traceback (its tail would leave the traceback out)."""
    start = max(text.find("Traceback") - 3000, 0)
    return text[start : start + 9000]


def metric_steps(save: str) -> set[int]:
    """The steps of the metrics.jsonl rank 0 mirrors into an s3:// save folder."""
    return {json.loads(line)["step"] for line in storage.read_bytes(f"{save}/metrics.jsonl").splitlines()}


def assert_nothing_left(node: Node) -> None:
    """The node's temp folder holds only what the run keeps; its /dev/shm held nothing when it exited (a
    killed generation's `sem.mp-*` semaphores included: shared/launch/ranks.py orphan_semaphores)."""
    # No process either: a rank killed from outside leaves children reparented to init (supervisor strays).
    running = processes_naming(node.folder)
    assert running == [], f"{node.folder.name} left processes running: {running}"
    left = sorted(p.name for p in (node.folder / "tmp").iterdir() if not p.name.startswith(RUN_KEEPS))
    assert left == [], f"{node.folder.name} left in its temp folder: {left}"
    shm = node.folder / "shm-left"
    assert shm.exists(), f"{node.folder.name}: its wrapper never listed /dev/shm"
    assert shm.read_text().split() == [], f"{node.folder.name} left in /dev/shm: {shm.read_text()}"


@pytest.fixture(scope="module")
def reference(
    tiny_dataset: str, s3_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """The uninterrupted two-node run: (data, save folder on S3)."""
    save = f"s3://{s3_server.bucket}/two-nodes-{uuid.uuid4().hex[:12]}/reference"
    with short_folder("sdn-") as base:
        job = Job(base, tiny_dataset, save, free_port())
        nodes = job.start_both()
        assert job.finish(*nodes) == [0, 0], job.logs()
        for node in nodes:
            assert_nothing_left(node)
    assert saved_batch(save) == MAX_BATCHES
    yield tiny_dataset, save


def test_the_uninterrupted_run_finishes_on_both_nodes_and_leaves_nothing_behind(
    reference: tuple[str, str],
) -> None:
    """The fixture's own checks: both nodes exit 0, nothing left in their temp folders or /dev/shm."""
    assert saved_batch(reference[1]) == MAX_BATCHES


def assert_matches(reference: str, save: str) -> None:
    assert saved_batch(save) == MAX_BATCHES
    assert_same_weights(final_state(save), final_state(reference), WEIGHT_ATOL)


def test_failures_and_a_sigterm_on_two_nodes_end_on_the_uninterrupted_runs_weights(
    reference: tuple[str, str],
) -> None:
    data, ref_save = reference
    with short_folder("sdn-") as base:
        save = ref_save.rsplit("/", 1)[0] + "/failures"
        stopped = crash_then_sigterm(Job(base / "first", data, save, free_port()))
        rerun = Job(base / "rerun", data, save, free_port())
        hang_then_lose_node_1(rerun, stopped)
        assert f"ba{stopped}" in rerun.nodes[0].text().split("autoresume: continuing from")[1].splitlines()[0]
    assert_matches(ref_save, save)
    assert metric_steps(save) == set(range(1, MAX_BATCHES + 1))


def crash_then_sigterm(job: Job) -> int:
    """kill -9 of a rank on node 1, then SIGTERM to node 0's launcher: the step every node saved."""
    node0, node1 = job.start_both()
    # kill -9 of one rank on node 1: node 0's ranks are stopped too (within the collective timeout) ...
    victim = job.wait_for_batch(node1, 3)[0]
    before = [beat.pid for beat in job.wait_for_batch(node0, 3)]
    os.kill(victim.pid, signal.SIGKILL)
    wait_gone(before, COLLECTIVE_TIMEOUT_S)
    # ... and every node's ranks start again (a new generation of processes) and go on.
    beats = job.wait_for_batch(node0, 5)
    assert not set(before) & {beat.pid for beat in beats}
    os.kill(node0.launcher_pid(), signal.SIGTERM)
    assert job.finish(node0, node1) == [control.EXIT_RESUMABLE] * 2, job.logs()
    stopped = saved_batch(job.save)
    assert 5 <= stopped < MAX_BATCHES
    # The stop's save mirrored the run folder too (it ends before FIT_END): a rerun elsewhere continues it.
    assert max(metric_steps(job.save)) == stopped
    assert "torchrun restarted every node's ranks" in node0.text()
    for node in (node0, node1):  # every node's ranks saved the same step and said so
        assert f"stopped at batch {stopped} on" in node.text() and "rerun the same command" in node.text()
        assert "Traceback" not in node.text(), around_traceback(node.text())  # the rank left behind: a line
        assert_nothing_left(node)
    assert f"({job.save}/ep" in node0.text()  # rank 0 names the checkpoint on S3, not its staged copy
    return stopped


def hang_then_lose_node_1(job: Job, resumed: int) -> None:
    """The rerun: SIGSTOP of a rank on node 1, then node 1 lost whole and replaced; the run finishes."""
    node0, node1 = job.start_both()
    # SIGSTOP of one rank on node 1: the watchdog names it, kills the node's ranks, every node restarts.
    stopped = job.wait_for_batch(node1, resumed + 1)[0]
    os.kill(stopped.pid, signal.SIGSTOP)
    job.wait_for_batch(node1, resumed + 3)
    text = node1.text()
    assert (
        f"(pid {stopped.pid}) is stopped (SIGSTOP" in text
        and f"--- rank {stopped.rank} (pid {stopped.pid}) ---" in text
    )
    # Node 1 lost whole: its supervisor, agent and ranks. A replacement (fresh local folders) joins.
    kill_tree(node1.proc.pid)
    node1.proc.wait()
    replacement = job.start(1, name="n1r")
    assert job.finish(node0, replacement) == [0, 0], job.logs()
    restarts = [line for line in node0.text().splitlines() if "torchrun restarted every node's ranks" in line]
    assert len(restarts) >= 2, restarts  # the hang, the lost node (a rendezvous may retry)
    for node in (node0, node1, replacement):  # the ranks left behind by each failure: a line each
        assert "Traceback" not in node.text(), around_traceback(node.text())
    for node in (node0, replacement):
        assert_nothing_left(node)
    assert processes_naming(node1.folder) == []  # lost whole: its earlier generations' strays were ended
