"""The real `python -m encode` entry point: kill -9 mid-run, then a rerun finishes the job exactly once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from encode.process.encoders import load_encoders
from encode.sample_data import build_webdataset
from shared.manifest import Layout
from shared.runtime.exits import DEBUG_ENV
from tests.encode.test_pipeline import HIGH, LOW, SMALL, encode, make_cfg, rows_by_key

SHARDS = 8
START_TIMEOUT_S = 240  # importing torch + diffusers + streaming on a loaded 2-core box
POLL_S = 0.02
ORPHAN_TIMEOUT_S = 10  # the kernel's SIGKILL to a worker whose parent died is immediate; leave room for load


def encode_cmd(src: Path, out: Path, *extra: str) -> list[str]:
    args = [
        f"source.uri={src}",
        f"output.uri={out}",
        "progress=false",
        "workers=1",
        "encoder.batch_size=4",
        *SMALL,
    ]
    return [sys.executable, "-m", "encode", "run", "sample", *args, *extra]


def done_markers(out: Path) -> list[Path]:
    return sorted(Path(Layout(str(out)).parts_dir()).glob("*/*.json"))


def kill_after_first_partition(cmd: list[str], out: Path) -> int:
    """Start the job, SIGKILL it the moment its first partition is published; return markers seen then.
    Its temp folder is under `out`: a killed process leaves what it would remove at exit (torch's import-time
    TemporaryDirectory), and this test owns that, not the suite's temp folder. Its decode workers must not
    outlive it (shared/runtime/children.py): before, one sat orphaned with ~490 MB, minutes later."""
    (out.parent / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(out.parent / "tmp")}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not done_markers(out):
        if proc.poll() is not None:
            raise AssertionError(
                f"encode exited early ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("encode published no partition in time")
        time.sleep(POLL_S)
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert workers, "encode ran without its decode worker: the test lost what it checks"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(workers, timeout=ORPHAN_TIMEOUT_S)
    for orphan in alive:
        orphan.kill()
    assert not alive, f"encode's workers outlived its kill -9: {[p.pid for p in alive]}"
    return len(done_markers(out))


@pytest.mark.slow
def test_kill_minus_9_then_rerun_gives_every_sample_exactly_once(tmp_path: Path) -> None:
    src, out = tmp_path / "in", tmp_path / "out"
    build_webdataset(src, shards=SHARDS, per_shard=16, seed=5)
    finished_at_kill = kill_after_first_partition(encode_cmd(src, out), out)
    assert finished_at_kill < SHARDS, "the job finished before it could be killed; give it more work"
    assert not (out / "manifest.json").exists()

    rerun = subprocess.run(encode_cmd(src, out), capture_output=True, text=True, check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"({finished_at_kill} already done)" in rerun.stdout
    assert not (out / "_staging").exists() or not any((out / "_staging").iterdir())

    reference = tmp_path / "reference"
    encoders = load_encoders(make_cfg(src, reference))
    encode(make_cfg(src, reference, "encoder.batch_size=4"), encoders)
    for res in (LOW, HIGH):
        got, want = rows_by_key(out, res), rows_by_key(reference, res)
        assert got.keys() == want.keys()
        for key, row in want.items():
            assert all(row[c].tobytes() == got[key][c].tobytes() for c in row if hasattr(row[c], "tobytes"))


@pytest.mark.slow
def test_sigterm_stops_encode_in_one_line_and_leaves_its_temp_folder_clean(tmp_path: Path) -> None:
    """The default action ended the process on the spot: reuse tables' copies and torch's import-time temp
    folder stayed in TMPDIR (Ctrl-C already cleaned up)."""
    src, out, temp = tmp_path / "in", tmp_path / "out", tmp_path / "tmp"
    build_webdataset(src, shards=SHARDS, per_shard=16, seed=5)
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    proc = subprocess.Popen(encode_cmd(src, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not done_markers(out):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "encode published no partition in time"
        time.sleep(POLL_S)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    text = err.decode()
    assert proc.returncode == 128 + signal.SIGTERM, text[-2000:]
    assert "stopped by SIGTERM; rerun the same command" in text and "Traceback" not in text
    assert sorted(p.name for p in temp.iterdir()) == []


def test_user_errors_print_one_line_naming_the_fix(tmp_path: Path) -> None:
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "encode",
            "run",
            "sample",
            f"source.uri={tmp_path}/nope",
            f"output.uri={tmp_path}/o",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 2
    assert "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    unknown = subprocess.run(
        [sys.executable, "-m", "encode", "run", "sample", "transform.resolutionz=[64]"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert unknown.returncode == 2 and "transform.resolutionz" in unknown.stderr
    build_webdataset(tmp_path / "src", shards=1, per_shard=4, seed=1)
    (tmp_path / "a-file").write_text("not a folder")
    in_the_way = subprocess.run(
        [sys.executable, "-m", "encode", "run", "sample", f"source.uri={tmp_path}/src",
         f"output.uri={tmp_path}/a-file", "workers=0", *SMALL],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert in_the_way.returncode == 2, in_the_way.stderr[-2000:]
    assert "Traceback" not in in_the_way.stderr
    assert "a part of the path is a file, not a folder" in in_the_way.stderr


def test_a_node_without_gpus_in_a_job_of_several_nodes_is_refused_before_the_models_load(
    tmp_path: Path,
) -> None:
    """encoder.device=auto (the sample config says cpu) on a node whose GPUs are not seen (rank 3 of 2 nodes,
    as torchrun sets it): it would encode its share on CPU for days while every other rank waits for it. One
    line naming the node and both fixes, exit 2, nothing written; encoder.device=cpu says a CPU job on several
    nodes means it (the sample config's own setting: the CPU on purpose)."""
    src, out = tmp_path / "in", tmp_path / "out"
    build_webdataset(src, shards=1, per_shard=2, seed=5)
    env = {
        **os.environ, DEBUG_ENV: "0", "CUDA_VISIBLE_DEVICES": "", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "RANK": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9",
    }  # fmt: skip
    done = subprocess.run(
        encode_cmd(src, out, "encoder.device=auto"),
        capture_output=True,
        text=True,
        env=env,
        timeout=START_TIMEOUT_S,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [each for each in done.stderr.strip().splitlines() if " INFO " not in each]
    node = socket.gethostname()
    assert f"encoder.device=auto but this node ({node}) sees no GPU, in a job of 2 nodes" in line
    assert line.endswith("or pass encoder.device=cpu for a CPU job on several nodes")
    assert not out.exists()
