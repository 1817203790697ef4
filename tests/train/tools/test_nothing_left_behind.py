"""A demo and a bench leave nothing behind (issue 31 item 4, issue 34 item 3): each runs as a user runs it
(`make demo`, `make bench`: the session's shared runs, tests/train/conftest.py demo_run and bench_alone),
with a temp folder of its own and a /dev/shm of its own (a private mount namespace, as a separate host has),
and afterwards both hold nothing but what a job keeps by design (tests/leftovers.py RUN_KEEPS): no Streaming
shared memory or file locks, no torchelastic folders, no inductor caches, no SeaweedFS logs, no
multiprocessing semaphores. The two-node test checks the same per node, also after kill -9 of a rank
(tests/train/resilience/test_two_nodes.py)."""

from __future__ import annotations

import pytest

from tests.leftovers import Alone
from tests.train.conftest import BenchRun, DemoRun

pytestmark = pytest.mark.slow


def assert_nothing_left(left: Alone) -> None:
    assert left.temp == [], f"left in its temp folder: {left.temp}"
    if left.shm is None:
        pytest.skip("no /dev/shm of its own here (needs `unshare -m` and a tmpfs mount: root)")
    assert left.shm == [], f"left in /dev/shm: {left.shm}"


def test_a_demo_leaves_nothing_in_the_temp_folder_or_dev_shm(demo_run: DemoRun) -> None:
    assert "leaked shared_memory" not in demo_run.output, demo_run.output[-3000:]
    assert_nothing_left(demo_run.left)


def test_a_bench_leaves_nothing_in_the_temp_folder_or_dev_shm(bench_alone: BenchRun) -> None:
    assert "leaked shared_memory" not in bench_alone.output, bench_alone.output[-3000:]
    assert_nothing_left(bench_alone.left)
