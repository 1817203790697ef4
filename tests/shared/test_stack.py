"""shared/runtime/stack.py: what `make wheelhouse` and `make install TORCH=system` take from the lock, the
tested range they check, and that the Makefile, pyproject and the lock agree with it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from shared.runtime.stack import (
    TESTED_PYTHON,
    TESTED_TORCH,
    lock_without_torch,
    major_minor,
    pin_name,
    stack_problems,
)

REPO = Path(__file__).resolve().parents[2]


def test_the_image_keeps_torch_torchvision_triton_and_the_cuda_wheels() -> None:
    lock = ["# header", "composer==0.32.1", "torch==2.7.0", "torchvision==0.22.0", "triton==3.3.0"]
    lock += ["nvidia-cudnn-cu12==9.5.1.17", "cuda-bindings==13.5.0", "sympy==1.14.0", "", "Jinja2==3.1.6"]
    assert lock_without_torch(lock) == ["composer==0.32.1", "sympy==1.14.0", "Jinja2==3.1.6"]
    assert pin_name("typing_extensions==4.16.0") == "typing-extensions"


def test_the_real_lock_without_torch_still_has_the_stack() -> None:
    pins = {
        pin_name(line) for line in lock_without_torch((REPO / "requirements.lock").read_text().splitlines())
    }
    assert {"composer", "mosaicml-streaming", "diffusers", "pytest", "pytest-timeout"} <= pins
    assert not {p for p in pins if p and re.match(r"torch$|torchvision|triton|nvidia-", p)}


def test_what_lies_outside_the_tested_range_is_named() -> None:
    assert stack_problems("3.12.1", "2.11.0+cu130", "13.0") == []
    assert stack_problems("3.11.7", "2.7.0+cu126", None) == []  # a CPU build
    assert stack_problems("3.13.0", "2.12.0", "13.1") == ["Python 3.13.0", "torch 2.12.0", "CUDA 13.1"]


def test_the_makefile_pyproject_and_lock_agree_with_the_tested_range() -> None:
    lock = (REPO / "requirements.lock").read_text()
    assert major_minor(re.search(r"^torch==(\S+)", lock, re.M).group(1)) == TESTED_TORCH[0]  # type: ignore[union-attr]
    makefile = (REPO / "Makefile").read_text()
    torch_next = re.search(r"^TORCH_NEXT \?= torch==(\S+)", makefile, re.M).group(1)  # type: ignore[union-attr]
    assert major_minor(torch_next) == TESTED_TORCH[1]
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert (
        requires
        == f">={TESTED_PYTHON[0][0]}.{TESTED_PYTHON[0][1]},<{TESTED_PYTHON[1][0]}.{TESTED_PYTHON[1][1] + 1}"
    )


def test_an_interpreter_without_torch_is_refused_naming_the_fix() -> None:
    # -S: no site-packages, so no torch; what `make install TORCH=system PYTHON=<a python without torch>` sees
    cmd = [sys.executable, "-S", "-m", "shared.runtime.stack", "check"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "no torch/torchvision to keep" in done.stderr and "without TORCH=system" in done.stderr
