"""What `python -m train` costs before a command needs torch: every process that is not a training rank (a
node's launch supervisor, a config error, `--help`) and every child Composer's S3 uploader spawns on each
rank (the `spawn` method re-imports the main module) used to import the whole CLI, torch, diffusers and
Composer included (~5 s of imports on 2 cores)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "composer", "diffusers", "transformers", "streaming")

PROBE = f"""
import runpy, sys
runpy.run_module("train", run_name="__mp_main__")  # what a spawned child runs of the main module
spawned = sorted(set({HEAVY!r}) & set(sys.modules))
import train.cli  # what every command loads before its own body
print(spawned, sorted(set({HEAVY!r}) & set(sys.modules)))
"""


def test_the_cli_and_a_spawned_child_import_no_torch_composer_or_diffusers() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[] []", done.stdout
