"""The /dev/shm sweep of shared/launch/ranks.py when other processes have a /dev/shm of their own (another
"node" on the same machine, a container): every tmpfs numbers its inodes from the same start, so a file
mapped there can carry the same inode number as an orphan here. The two-node test once kept three of node 0's
orphaned semaphores because node 1's ranks, still running, mapped files with their inode numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.leftovers import in_private_shm, private_shm_works

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not private_shm_works(), reason="needs `unshare -m` and a tmpfs mount (root): a /dev/shm of its own"
)

# In a /dev/shm of its own: one file, mapped, held until stdin closes; prints its inode number.
HOLD = """
import mmap, os, sys
fd = os.open("/dev/shm/sem.mp-held", os.O_CREAT | os.O_RDWR); os.ftruncate(fd, 4096)
view = mmap.mmap(fd, 4096)
print(os.fstat(fd).st_ino, flush=True)
sys.stdin.read()
"""
# In another /dev/shm of its own: one file nobody maps (a dead rank's semaphore), then the sweep's verdict.
SWEEP = """
import json, os
from shared.launch.ranks import orphan_semaphores, unmapped_shm
path = "/dev/shm/sem.mp-orphan"
os.close(os.open(path, os.O_CREAT | os.O_RDWR))
found = orphan_semaphores(0)
seen = {"inode": os.stat(path).st_ino, "orphans": sorted(found), "unmapped": sorted(unmapped_shm(found))}
print(json.dumps(seen))
"""


def test_an_orphan_whose_inode_number_another_dev_shm_maps_is_still_swept(tmp_path: Path) -> None:
    env = {**os.environ, "SHM_LEFT": str(tmp_path / "left"), "PYTHONPATH": str(REPO_ROOT)}
    holder = subprocess.Popen(
        in_private_shm([sys.executable, "-c", HOLD]), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**env, "SHM_LEFT": str(tmp_path / "held-left")}, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        held_inode = int(holder.stdout.readline())
        done = subprocess.run(
            in_private_shm([sys.executable, "-c", SWEEP]), capture_output=True, text=True, env=env,
            cwd=REPO_ROOT, timeout=60, check=False,
        )  # fmt: skip
    finally:
        holder.communicate("", timeout=30)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    if seen["inode"] != held_inode:
        pytest.skip(f"this kernel gave the two tmpfs files different inode numbers ({seen}, {held_inode})")
    assert seen["orphans"] == seen["unmapped"] == ["/dev/shm/sem.mp-orphan"]


# In a /dev/shm of its own: one file mapped and kept, one mapped and unlinked (a DataLoader batch in shared
# memory), then what the supervisor records of this process.
MAPS = """
import json, mmap, os
from shared.launch.ranks import mapped_shm
views = []
for name in ("000000_locals", "torch_1_2_3"):
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR); os.ftruncate(fd, 4096)
    views.append(mmap.mmap(fd, 4096))
os.unlink("/dev/shm/torch_1_2_3")
print(json.dumps(sorted(mapped_shm([os.getpid()]))))
"""


def test_the_supervisor_records_no_unlinked_shared_memory(tmp_path: Path) -> None:
    """Each DataLoader batch in shared memory is an unlinked /dev/shm file: their names grew the supervisor's
    set by 4 a second (1 GB a node over 1M steps of the SD2 recipe), and its exit sweep stat'ed each."""
    env = {**os.environ, "SHM_LEFT": str(tmp_path / "left"), "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        in_private_shm([sys.executable, "-c", MAPS]), capture_output=True, text=True, env=env, cwd=REPO_ROOT,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["/dev/shm/000000_locals"]
