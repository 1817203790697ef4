"""`make test-gpu` (tests/gpu_check.py) on a machine without CUDA, and its bounds on hand-made tests: a test
over its limit (ignoring SIGTERM) is "timed out" and the next one still runs; without CUDA the check ends in
seconds with every test skipped and the reason in the JSON; its list is the tests marked `gpu`."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import gpu_check
from tests.gpu_check import GPU_TESTS, Check, bench_headline, outcome_of

REPO = Path(__file__).resolve().parents[1]
NO_CUDA_WITHIN_S = 60  # torch's import on 2 shared cores; about 3 s on a GPU machine


def is_gpu_mark(node: ast.expr) -> bool:
    return "mark.gpu" in ast.unparse(node)


def gpu_marked_tests() -> set[str]:
    """Every test function marked `gpu`, itself or by its module's `pytestmark`, as a node id."""
    found = set()
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_mark = any(
            isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
            and is_gpu_mark(n.value) for n in tree.body
        )  # fmt: skip
        for node in tree.body:
            is_test = isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
            if is_test and (module_mark or any(is_gpu_mark(d) for d in node.decorator_list)):
                found.add(f"{path.relative_to(REPO)}::{node.name}")
    return found


def test_the_check_runs_exactly_the_tests_marked_gpu() -> None:
    assert set(GPU_TESTS) == gpu_marked_tests()
    assert sum(GPU_TESTS.values()) + gpu_check.BENCH_S > gpu_check.BUDGET_S  # the budget, not the sum, binds


def test_without_cuda_it_ends_in_seconds_everything_skipped_and_says_why(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "tests.gpu_check",
        "--out",
        str(tmp_path / "out"),
        "--cache",
        str(tmp_path / "c"),
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - start < NO_CUDA_WITHIN_S
    result = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert "needs a CUDA device" in result["skipped_reason"] and result["cuda_available"] is False
    assert {t["outcome"] for t in result["tests"].values()} == {"skipped"}
    assert set(result["tests"]) == set(GPU_TESTS)
    assert result["bench"]["outcome"] == "skipped"
    assert result["compile_cache"] == str(tmp_path / "c") and result["torch"] and "tested_range" in result


HANDMADE = """
import signal, time

def test_hangs_and_ignores_sigterm():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what a finished in-process fit() used to leave behind
    time.sleep(600)

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "wrong"
"""


def test_a_test_over_its_limit_is_timed_out_with_its_stacks_and_the_next_still_runs(tmp_path: Path) -> None:
    tests = tmp_path / "test_handmade.py"
    tests.write_text(HANDMADE)
    (tmp_path / "out" / "logs").mkdir(parents=True)
    check = Check(tmp_path / "out", tmp_path / "cache", budget_s=600)
    limit = 12
    start = time.monotonic()
    check.run_test(f"{tests}::test_hangs_and_ignores_sigterm", limit, 0, [])
    assert time.monotonic() - start < limit + 3 * gpu_check.GRACE_S
    check.run_test(f"{tests}::test_passes", 120, 0, [])
    check.run_test(f"{tests}::test_fails", 120, 0, [])
    got = {nodeid.split("::")[-1]: entry for nodeid, entry in check.result["tests"].items()}
    assert got["test_hangs_and_ignores_sigterm"]["outcome"] == "timed out"
    assert "test_hangs_and_ignores_sigterm" in Path(got["test_hangs_and_ignores_sigterm"]["log"]).read_text()
    assert got["test_passes"]["outcome"] == "passed"
    assert got["test_fails"]["outcome"] == "failed" and "wrong" in got["test_fails"]["reason"]


def test_the_budget_left_decides_what_still_runs(tmp_path: Path) -> None:
    check = Check(tmp_path, tmp_path / "cache", budget_s=30)
    check.run_test("tests/any.py::test_x", 60, bench_s=28, pytest_args=[])
    assert check.result["tests"]["tests/any.py::test_x"]["outcome"] == "not run"
    check = Check(tmp_path, tmp_path / "cache", budget_s=50)  # 20 s would be left for a test of 150 s
    check.run_test("tests/any.py::test_y", 150, bench_s=20, pytest_args=[])
    entry = check.result["tests"]["tests/any.py::test_y"]
    assert entry["outcome"] == "not run" and "of the test's 150 s" in entry["reason"]


def test_outcomes_from_the_plugins_events() -> None:
    start = {"nodeid": "t", "phase": "start"}
    setup = {"nodeid": "t", "phase": "setup", "outcome": "passed", "seconds": 1.0, "reason": None}
    call = {"nodeid": "t", "phase": "call", "outcome": "passed", "seconds": 2.0, "reason": None}
    teardown = {"nodeid": "t", "phase": "teardown", "outcome": "passed", "seconds": 0.5, "reason": None}
    assert outcome_of([start, setup, call, teardown], killed=False) == {"outcome": "passed", "seconds": 3.5}
    assert outcome_of([start, setup], killed=True)["outcome"] == "timed out"
    assert outcome_of([], killed=False)["outcome"] == "not run"


def test_the_bench_headline_reads_what_is_there() -> None:
    bench = {
        "device": "NVIDIA H100 80GB HBM3",
        "train": {"256": {"images_per_s_per_device": 199.0, "mfu": 0.109, "batch_size": 32}},
        "trainer": {"outside_step_share": 0.108, "as_recipe": {"256": {"images_per_s_per_device": 150.0}}},
        "headline": {"new_key": 1},  # a key a later bench may add
    }
    head = bench_headline(bench)
    assert head["step"]["256"] == {
        "images_per_s": 199.0,
        "mfu": 0.109,
        "batch_size": 32,
        "peak_memory_gb": None,
    }
    assert head["encode_samples_per_s"] is None and head["composer_outside_step_share"] == 0.108
    assert head["as_recipe"] == {"256": {"images_per_s": 150.0, "mfu": None}}
    assert head["headline"] == {"new_key": 1}
    assert bench_headline({})["step"] == {}
    assert head["complete"] is True and "stopped_in" not in head
    stopped = bench_headline(bench | {"complete": False, "running": "encode"})  # stopped at its limit
    assert stopped["complete"] is False and stopped["stopped_in"] == "encode"
    assert stopped["step"]["256"]["mfu"] == 0.109


@pytest.mark.slow
def test_the_gpu_list_collects_without_the_s3_dependencies(tmp_path: Path) -> None:
    for module in ("boto3", "botocore", "s3transfer"):  # importing any of them fails
        (tmp_path / f"{module}.py").write_text(f"raise ImportError('{module}: an S3 dependency')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *GPU_TESTS]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{len(GPU_TESTS)} tests collected" in done.stdout


def test_the_bench_overrides_fit_bench_full() -> None:
    from train.bench.config import load_bench_config

    cfg = load_bench_config("full", list(gpu_check.BENCH_ARGS))
    assert cfg.step.resolutions == [256, 512] and cfg.encode.enabled and cfg.trainer.enabled
    assert not (cfg.scale.s3 or cfg.scale.collectives)
    # no cold compile of SD2 (over 200 s a shape on an H200): the recipe, its trainer run and the VAE eager
    assert cfg.recipe_overrides == ["compile=false"] and not cfg.encode.vae_compile
    assert "encoder.compile=true" not in cfg.encode.encoder_overrides  # the pipeline's VAE eager too
    assert not (cfg.anatomy.enabled or cfg.buckets.enabled)
