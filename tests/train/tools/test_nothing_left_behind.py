"""A demo and a bench leave nothing behind (issue 31 item 4, issue 34 item 3): each runs as a user runs it
(`python -m train demo`, `python -m train bench`), with a temp folder of its own and a /dev/shm of its own (a
private mount namespace, as a separate host has), and afterwards both hold nothing but what a job keeps by
design (tests/leftovers.py RUN_KEEPS): no Streaming shared memory or file locks, no torchelastic folders, no
inductor caches, no SeaweedFS logs, no multiprocessing semaphores. The two-node test checks the same per
node, also after kill -9 of a rank (tests/train/resilience/test_two_nodes.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.leftovers import RUN_KEEPS, in_private_shm, private_shm_works
from tests.train.conftest import REPO_ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not private_shm_works(), reason="needs `unshare -m` and a tmpfs mount (root)"),
]

# The quick bench cut to seconds, every section that starts processes or servers still on: the loader
# (Streaming workers), the trainer (Composer), buckets, encode (decode workers), S3 (SeaweedFS) and the
# 2-rank gloo collectives job (FSDP). The recipe as run and the host twin run Composer's trainer in this
# process again, as the trainer section does, so they are off (~45 s on 2 cores).
SMALL_BENCH = [
    "step.resolutions=[64]", "step.repeats=1", "loader.rows=16", "loader.passes=1", "trainer.batches=2",
    "trainer.warmup=1", "trainer.as_recipe=false", "trainer.host_twin=false", "anatomy.enabled=false",
    "buckets.repeats=1", "buckets.bucket_step=16", "buckets.loader_rows=4", "encode.samples=8",
    "encode.repeats=1", "encode.vae_resolutions=[]", "scale.s3_batches=3", "scale.s3_checkpoint_interval=1",
    "scale.ckpt_width=16", "scale.ckpt_depth=1", "scale.ckpt_repeats=1",
]  # fmt: skip


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp folder: the bench's SeaweedFS listens on a Unix socket in it, and a socket path may not
    exceed 107 bytes (pytest's tmp_path is too deep)."""
    base = Path(tempfile.mkdtemp(prefix="sdl-", dir="/tmp"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_alone(base: Path, args: list[str], timeout_s: float) -> tuple[list[str], list[str]]:
    """`python -m train ARGS` with a temp folder and /dev/shm of its own: (temp, /dev/shm) entries left."""
    temp, shm_left = base / "tmp", base / "shm-left"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "SHM_LEFT": str(shm_left)}
    cmd = in_private_shm([sys.executable, "-m", "train", *args])
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "leaked shared_memory" not in done.stderr, done.stderr[-3000:]
    left = sorted(p.name for p in temp.iterdir() if not p.name.startswith(RUN_KEEPS))
    return left, shm_left.read_text().split()


def test_a_demo_leaves_nothing_in_the_temp_folder_or_dev_shm(short_tmp: Path) -> None:
    left, shm = run_alone(short_tmp, ["demo", "--out", str(short_tmp / "demo"), "--max-duration", "4ba"], 600)
    assert (left, shm) == ([], [])


def test_a_bench_leaves_nothing_in_the_temp_folder_or_dev_shm(short_tmp: Path) -> None:
    args = ["bench", "quick", f"out_dir={short_tmp / 'bench'}", *SMALL_BENCH]
    left, shm = run_alone(short_tmp, args, 600)
    assert (left, shm) == ([], [])
