"""The launch flags both stages' `launch` commands share, and the plan -> print or execute wrapper."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Annotated

import typer

from shared.batching import BatchingError
from shared.config import ConfigError
from shared.launch.plan import LaunchError, LaunchOptions, LaunchPlan
from shared.launch.report import describe, summarize
from shared.launch.submit import execute
from shared.storage import redact_url


class LauncherChoice(enum.StrEnum):
    local = "local"
    slurm = "slurm"
    k8s = "k8s"


GpusOpt = Annotated[int, typer.Option("--gpus", help="total GPUs (ranks); no GPU here: CPU ranks on gloo")]
NodesOpt = Annotated[int | None, typer.Option("--nodes", help="nodes to spread them over [GPUS / 8]")]
PerNodeOpt = Annotated[int | None, typer.Option("--gpus-per-node", help="GPUs per node [8, or GPUS if less]")]
LauncherOpt = Annotated[LauncherChoice, typer.Option("--launcher", help="where the ranks run")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="print the plan and the specs; launch nothing")]
NodeRankOpt = Annotated[int | None, typer.Option("--node-rank", help="local multi-node: this machine's rank")]
MasterAddrOpt = Annotated[str | None, typer.Option("--master-addr", help="local multi-node: node 0's host")]
MasterPortOpt = Annotated[int, typer.Option("--master-port", help="rendezvous port on node 0")]
NameOpt = Annotated[str | None, typer.Option("--name", help="job name [sd-<job>-<config>]")]
ImageOpt = Annotated[str | None, typer.Option("--image", help="k8s: image with this repo installed")]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", help="k8s: namespace [kubectl's current]")]
SecretOpt = Annotated[str, typer.Option("--secret", help="k8s: Secret with AWS_* / HF_TOKEN keys (optional)")]
PartitionOpt = Annotated[str | None, typer.Option("--partition", help="slurm: partition")]
AccountOpt = Annotated[str | None, typer.Option("--account", help="slurm: account")]
TimeOpt = Annotated[str | None, typer.Option("--time", help="slurm: time limit, e.g. 3-00:00:00")]
EfaOpt = Annotated[bool, typer.Option("--efa", help="add the AWS EFA knobs of jobs/launch/env.yaml")]
CpusPerRankOpt = Annotated[
    int | None, typer.Option("--cpus-per-rank", help="CPUs per rank [data workers + 1, from the config]")
]
MemPerRankOpt = Annotated[
    int | None, typer.Option("--mem-per-rank-gb", help="host memory per rank in GiB [the job's estimate]")
]
SbatchOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--sbatch-option", help="slurm: extra #SBATCH option, e.g. qos=high or requeue (repeatable)"
    ),
]
GpuTypeOpt = Annotated[str, typer.Option("--gpu-type", help="GPU type for the cost estimate line")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="key=value overrides for the job's config")]


def launch_options(params: Mapping[str, object]) -> Callable[[], LaunchOptions]:
    """LaunchOptions from a command's parameters of the same names (built inside the error handler)."""
    names = {f.name for f in dataclasses.fields(LaunchOptions)}
    chosen = {name: value for name, value in params.items() if name in names}
    chosen["launcher"] = str(chosen["launcher"])
    chosen["sbatch_options"] = list(chosen.get("sbatch_options") or [])
    return lambda: LaunchOptions(**chosen)  # type: ignore[arg-type]


def echo(text: str, err: bool = False) -> None:
    """Everything the launcher prints goes through here: URL userinfo (a password) is never shown."""
    typer.echo(redact_url(text), err=err)


def run_cli(make_plan: Callable[[], LaunchPlan], dry_run: bool) -> None:
    """Build the plan, then print it (dry run) or carry it out; user errors exit 2 with their fix."""
    try:
        plan = make_plan()
        if dry_run:
            echo(describe(plan))
            return
        echo(summarize(plan))
        execute(plan, echo=echo)
    except (LaunchError, ConfigError, BatchingError) as err:
        echo(f"launch error: {err}", err=True)
        raise typer.Exit(2) from None
