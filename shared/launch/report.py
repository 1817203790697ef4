"""A launch plan as text: the summary block and, for a dry run, every command with its rendered spec."""

from __future__ import annotations

import shlex

from shared.batching import Batching
from shared.launch.plan import LaunchPlan, Step, plural
from shared.launch.steps import layout


def describe(plan: LaunchPlan) -> str:
    """The whole plan as the dry run prints it: the summary, then every command with its spec."""
    lines = [summarize(plan)]
    for number, step in enumerate(plan.steps, 1):
        lines += ["", f"step {number}: {step.what}", "$ " + _shell_line(step)]
        if step.stdin is not None:
            lines += [f"----- {step.file_name} (stdin of the command above) -----", step.stdin.rstrip("\n")]
            lines.append(f"----- end of {step.file_name} -----")
    return "\n".join(lines)


def summarize(plan: LaunchPlan) -> str:
    """Layout, batching, what every rank runs, finalize, estimate and notes: one row each."""
    launcher = plan.options.launcher
    if plan.options.picked:
        launcher += f" (LAUNCHER=auto: {plan.options.picked}; LAUNCHER=local|slurm|k8s picks another)"
    rows = [("launcher", launcher), ("layout", _layout(plan))]
    if plan.batching:
        rows.append(("batch", _batch_line(plan.batching)))
    if plan.memory:
        rows.append(("memory", plan.memory))
    if plan.resources:
        rows.append(("per rank", _resources_line(plan)))
    rows += [("cluster", line) for line in plan.cluster]
    rows.append(("every rank runs", "python -m " + shlex.join(plan.program)))
    if plan.finalize:
        rows.append(("finalize", plan.finalize))
    if plan.estimate:
        rows.append(("estimate", plan.estimate))
    rows += [("reference", line) for line in plan.reference]
    rows += [("node-local", line) for line in plan.node_local]
    rows += [("note", note) for note in plan.notes]
    rows += [("refused", reason) for reason in plan.refusals]
    width = max(len(key) for key, _ in rows)
    lines = [f"launch plan: {plan.job} {plan.target} ({plan.name})"]
    lines += [f"  {key.ljust(width)}  {value}" for key, value in rows]
    return "\n".join(lines)


def _batch_line(b: Batching) -> str:
    return (
        f"global {b.global_batch} = {plural(b.world_size, 'rank')} x {b.per_rank_batch} per rank; "
        f"microbatch {b.microbatch} x {plural(b.grad_accum, 'accumulation step')}"
    )


def _resources_line(plan: LaunchPlan) -> str:
    res = plan.resources
    assert res is not None
    return f"{plural(res.cpus, 'CPU')}, {res.memory_gb} GiB memory ({res.basis})"


def _layout(plan: LaunchPlan) -> str:
    topo = plan.topology
    if plan.job == "encode" and plan.options.launcher == "slurm":
        return f"{plural(topo.world_size, 'array task')} x 1 GPU (world size {topo.world_size})"
    return f"{layout(topo)} (world size {topo.world_size})"


def _shell_line(step: Step) -> str:
    env = "".join(f"{key}={shlex.quote(value)} " for key, value in step.env.items())
    stdin = f" < {step.file_name}" if step.stdin is not None else ""
    return env + shlex.join(step.argv) + stdin
