"""Carry a launch plan out: become torchrun (local), or submit the specs and report how to follow them."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from shared.launch.plan import ARRAY_JOB_ID, LaunchError, LaunchPlan, Step, workdir
from shared.launch.supervisor import Supervision, Supervisor
from shared.runtime.exits import torchrun_argv

# What to do when a cluster binary is missing from PATH.
BINARY_FIXES = {
    "sbatch": "run this on a Slurm login node, or add --dry-run and submit the printed script yourself",
    "kubectl": "install kubectl and point it at the cluster (kubectl config use-context ...), or add "
    "--dry-run and `kubectl apply -f` the printed manifest yourself",
}


def execute(plan: LaunchPlan, echo: Callable[[str], None] = print) -> None:
    """Run the plan's steps. Local: becomes torchrun (never returns). Else: submits and reports the ids."""
    require_binaries(plan)
    if plan.options.launcher == "local":
        if plan.supervision is None:
            exec_step(plan.steps[0])
        sys.exit(supervise_step(plan.steps[0], plan.supervision))
    job_ids: list[str] = []
    for step in plan.steps:
        argv = [arg.replace(ARRAY_JOB_ID, job_ids[-1]) if job_ids else arg for arg in step.argv]
        output = run_step(argv, step)
        if argv[0] == "sbatch":
            job_ids.append(parse_job_id(output, argv))
            echo(f"submitted {step.what}: Slurm job {job_ids[-1]}")
        else:
            echo(output.rstrip("\n"))
    echo(follow_up(plan, job_ids))


def require_binaries(plan: LaunchPlan) -> None:
    for step in plan.steps:
        binary = step.argv[0]
        if shutil.which(binary) is None:
            fix = BINARY_FIXES.get(binary, "install it or fix PATH")
            launcher = plan.options.launcher
            raise LaunchError(f"`{binary}` not found on PATH, needed by the {launcher} launcher: {fix}")


def exec_step(step: Step) -> NoReturn:
    """Replace this process with the step's command, so signals (Ctrl-C, a kill) reach torchrun directly.
    torchrun runs through shared/runtime/exits.py, as under the supervisor: no traceback box for ranks that
    stopped on purpose, and no torchelastic_* folder left in the temp folder."""
    sys.stdout.flush()
    sys.stderr.flush()
    argv = torchrun_argv(list(step.argv))
    os.execve(argv[0], argv, {**os.environ, **step.env})


def supervise_step(step: Step, supervision: Supervision) -> int:
    """Run the step under a supervisor that stays this process (signals, restarts, hangs); its exit code."""
    sys.stdout.flush()
    return Supervisor(step.argv, supervision, env={**os.environ, **step.env}).run()


def run_step(argv: Sequence[str], step: Step) -> str:
    env = {**os.environ, **step.env}
    result = subprocess.run(argv, input=step.stdin, text=True, capture_output=True, env=env, check=False)
    if result.returncode:
        raise LaunchError(
            f"`{shlex.join(argv)}` failed with exit code {result.returncode} while submitting {step.what}: "
            f"{(result.stderr or result.stdout).strip()}"
        )
    return result.stdout


def parse_job_id(output: str, argv: Sequence[str]) -> str:
    """`sbatch --parsable` prints `<id>` or `<id>;<cluster>`."""
    job_id = output.strip().split(";")[0]
    if not job_id.isdigit():
        raise LaunchError(f"`{shlex.join(argv)}` printed {output.strip()!r}, not a Slurm job id")
    return job_id


def follow_up(plan: LaunchPlan, job_ids: Sequence[str]) -> str:
    """How to watch what was just submitted."""
    if job_ids:
        log = f"{workdir()}/slurm-{plan.name}-{job_ids[0]}" + ("_<rank>" if plan.job == "encode" else "")
        text = f"watch: squeue -j {','.join(job_ids)}; logs: {log}.out"
        if plan.job == "encode":
            text += "; a failed rank cancels the finalize job: rerun the same command (done partitions stay)"
        return text
    namespace = f" -n {plan.options.namespace}" if plan.options.namespace else ""
    return (
        f"watch: kubectl get pods{namespace} -l job-name={plan.name}; "
        f"logs: kubectl logs{namespace} -f -l job-name={plan.name} --prefix; "
        f"stop: kubectl delete{namespace} job,service {plan.name}"
    )
