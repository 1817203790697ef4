"""The local launcher running the real train job on CPU ranks (gloo), through `python -m train launch`.

- 2 ranks and 1 rank with the same global batch follow the same loss trajectory (per-sample seeds and
  Streaming's elastic sample order make the global batches identical);
- two launcher invocations as node 0 and node 1 of one rendezvous on localhost train and checkpoint; both
  are then stopped the way a scheduler stops them (SIGTERM to each node's torchrun) and the same two
  commands resume from the last checkpoint and finish.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pytest

from tests.train.conftest import tiny_overrides, write_fake_dataset
from train.checkpoints.files import LATEST_NAME

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 480
STOP_TIMEOUT_S = 60
POLL_S = 0.05
# Float tolerance between 1 and 2 ranks: the same samples, gradients summed in a different order.
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-7
FAST = ["samples.enabled=false", "global_batch_size=4", "device_microbatch_size=2"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args: list[str], log: Path, wrapper: Sequence[str] = (), **env: str) -> subprocess.Popen:
    """`python -m train launch ...`, which becomes torchrun; output appended to `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    argv = [*wrapper, sys.executable, "-m", "train", "launch", "--config", "tiny", *args]
    with log.open("a") as handle:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path) -> None:
    assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, log.read_text()[-4000:]


def own_host_wrapper() -> list[str]:
    """A prefix that runs a command with its own /dev/shm, like a second machine.

    MosaicML Streaming keeps per-host state in /dev/shm (and lock files in the temp dir), named by a prefix
    each node's local leader picks; two nodes on one host pick the same prefix at the same moment. The
    prefix execs, so signals sent to the wrapped process reach the command itself.
    """
    script = 'mount -t tmpfs sd-node-shm /dev/shm && exec "$@"'
    wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "own-host"]
    probe = subprocess.run([*wrapper, "true"], capture_output=True, check=False)
    if probe.returncode:
        pytest.skip(
            "simulating a second node on this host needs a private /dev/shm (unshare --mount as root)"
        )
    return wrapper


def tails(logs: Iterable[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)


def metrics(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def processes_mentioning(marker: str) -> list[int]:
    """Live pids whose command line contains `marker` (read-only scan of /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("launch-train") / "data"
    write_fake_dataset(root, n=32)  # 8 global batches of 4 per epoch
    return str(root)


@pytest.mark.dist
@pytest.mark.slow
def test_two_cpu_ranks_follow_the_one_rank_loss_trajectory(dataset: str, tmp_path: Path) -> None:
    losses = {}
    for gpus in (1, 2):
        save, log = tmp_path / f"save{gpus}", tmp_path / f"ranks{gpus}.log"
        overrides = tiny_overrides(dataset, save, tmp_path / f"cache{gpus}", "max_duration=6ba", *FAST)
        finish(launch(["--gpus", str(gpus), *overrides], log), log)
        assert f"global batch 4 = {gpus} ranks x {4 // gpus}" in log.read_text()
        losses[gpus] = [row["loss"] for row in metrics(save)]
    assert len(losses[1]) == 6
    np.testing.assert_allclose(losses[2], losses[1], rtol=LOSS_RTOL, atol=LOSS_ATOL)


@pytest.mark.dist
@pytest.mark.slow
def test_two_local_nodes_train_checkpoint_and_resume_after_being_stopped(
    dataset: str, tmp_path: Path
) -> None:
    save, port = tmp_path / "save", free_port()
    settings = ["max_duration=12ba", "save_interval=4ba", "device=cpu", *FAST]  # a CPU job on 2 nodes says so
    second_host = own_host_wrapper()

    def start_nodes() -> list[tuple[subprocess.Popen, Path]]:
        nodes = []
        for rank in (0, 1):
            # Each "node" has its own shard cache, as separate machines would.
            overrides = tiny_overrides(dataset, save, tmp_path / f"cache-node{rank}", *settings)
            # Both "nodes" see one save folder (one machine): say so, or a local one on 2 nodes is refused.
            flags = ["--gpus", "2", "--nodes", "2", "--node-rank", str(rank), "--shared-save-folder"]
            flags += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
            log, tmp = tmp_path / f"node{rank}.log", tmp_path / f"tmp-node{rank}"
            tmp.mkdir(exist_ok=True)
            wrapper = second_host if rank else []
            nodes.append((launch([*flags, *overrides], log, wrapper, TMPDIR=str(tmp)), log))
        return nodes

    first = start_nodes()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (save / LATEST_NAME).exists():
        assert all(proc.poll() is None for proc, _ in first), tails(log for _, log in first)
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(POLL_S)
    for proc, _ in first:
        proc.send_signal(signal.SIGTERM)  # the launcher exec'd into torchrun, which stops its ranks
    for proc, _ in first:
        assert proc.wait(timeout=STOP_TIMEOUT_S) != 0
    assert not processes_mentioning(str(save)), "ranks outlived their torchrun"
    resumed_from = os.path.realpath(save / LATEST_NAME)

    for proc, log in start_nodes():
        finish(proc, log)
    assert f"autoresume: continuing from {resumed_from}" in (tmp_path / "node0.log").read_text()
    assert (save / "ep1-ba12-rank0.pt").exists()
    assert [row["step"] for row in metrics(save)] == list(range(1, 13))
