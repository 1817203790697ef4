"""When a scheduler will end this job: a Slurm job's EndTime (its --time limit), read with scontrol.

Slurm signals every process of a job at once at its time limit and SIGKILLs them KillWait (~30 s) later, and
`--signal=B:USR1@N` may arrive up to 60 s early or late; so the ranks work out the end themselves and save
`lead` seconds before it. The signal stays in the script as a backstop.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from datetime import datetime

SCONTROL_TIMEOUT_S = 30
_END_TIME = re.compile(r"\bEndTime=(\S+)")


def slurm_end_time(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds since the epoch at which Slurm ends this job; None outside Slurm or without a limit."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        done = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job],
            capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_end_time(done.stdout) if done.returncode == 0 else None


def parse_end_time(text: str) -> float | None:
    """`EndTime=2026-11-25T18:00:00` (the cluster's local time) -> epoch seconds; Unknown / None: None."""
    match = _END_TIME.search(text)
    if not match:
        return None
    try:
        return datetime.fromisoformat(match.group(1)).timestamp()
    except ValueError:
        return None
