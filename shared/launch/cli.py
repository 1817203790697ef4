"""The launch flags both stages' `launch` commands share, and the plan -> print or execute wrapper.

Each stage writes only its own part of the command (its config, overrides, planner flags) as a function
that returns a LaunchPlan; `launch_command` adds the shared flags below to it and makes it a typer command.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import typer

from shared.batching import BatchingError
from shared.config import ConfigError
from shared.launch.plan import DEFAULT_MASTER_PORT, LaunchError, LaunchOptions, LaunchPlan
from shared.launch.report import describe, summarize
from shared.launch.submit import execute
from shared.storage import redact_url


class LauncherChoice(enum.StrEnum):
    auto = "auto"  # local for one node, else Slurm / Kubernetes where found (shared/launch/plan.py)
    local = "local"
    slurm = "slurm"
    k8s = "k8s"


GpusOpt = Annotated[int, typer.Option("--gpus", help="total GPUs (ranks); no GPU here: CPU ranks on gloo")]
NodesOpt = Annotated[int | None, typer.Option("--nodes", help="nodes to spread them over [GPUS / 8]")]
PerNodeOpt = Annotated[int | None, typer.Option("--gpus-per-node", help="GPUs per node [8, or GPUS if less]")]
LauncherOpt = Annotated[
    LauncherChoice,
    typer.Option("--launcher", help="where the ranks run (auto: sbatch / kubectl when found and >1 node)"),
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="print the plan and the specs; launch nothing")]
NodeRankOpt = Annotated[
    int | None,
    typer.Option(
        "--node-rank", help="local multi-node: this machine's number (0 hosts the rendezvous store)"
    ),
]
MasterAddrOpt = Annotated[
    str | None, typer.Option("--master-addr", help="local multi-node: node 0's host (the rendezvous)")
]
MasterPortOpt = Annotated[int, typer.Option("--master-port", help="rendezvous port on node 0")]
NameOpt = Annotated[str | None, typer.Option("--name", help="job name [sd-<job>-<config>]")]
ImageOpt = Annotated[str | None, typer.Option("--image", help="k8s: image with this repo installed")]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", help="k8s: namespace [kubectl's current]")]
SecretOpt = Annotated[str, typer.Option("--secret", help="k8s: Secret with AWS_* / HF_TOKEN keys (optional)")]
PartitionOpt = Annotated[str | None, typer.Option("--partition", help="slurm: partition")]
AccountOpt = Annotated[str | None, typer.Option("--account", help="slurm: account")]
TimeOpt = Annotated[str | None, typer.Option("--time", help="slurm: time limit, e.g. 3-00:00:00")]
EfaOpt = Annotated[bool, typer.Option("--efa", help="add the AWS EFA knobs of jobs/launch/env.yaml")]
EfaDevicesOpt = Annotated[
    int | None, typer.Option("--efa-devices", help="k8s with --efa: EFA interfaces per pod (p5.48xlarge: 32)")
]
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


def known_gpu_type(value: str) -> str:
    """--gpu-type names a row of the planner's GPU table (shared/estimate/gpus.py)."""
    from shared.estimate.gpus import GPU_TABLE

    if value not in GPU_TABLE:
        raise typer.BadParameter(f"unknown GPU type {value!r}; use one of {', '.join(GPU_TABLE)}")
    return value


GpuTypeOpt = Annotated[
    str,
    typer.Option(
        "--gpu-type", help="GPU type for the cost estimate and memory lines", callback=known_gpu_type
    ),
]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="key=value overrides for the job's config")]


def launch_flags(
    gpus: GpusOpt = 1,
    nodes: NodesOpt = None,
    gpus_per_node: PerNodeOpt = None,
    launcher: LauncherOpt = LauncherChoice.auto,
    dry_run: DryRunOpt = False,
    node_rank: NodeRankOpt = None,
    master_addr: MasterAddrOpt = None,
    master_port: MasterPortOpt = DEFAULT_MASTER_PORT,
    name: NameOpt = None,
    image: ImageOpt = None,
    namespace: NamespaceOpt = None,
    secret: SecretOpt = LaunchOptions.secret,
    partition: PartitionOpt = None,
    account: AccountOpt = None,
    time_limit: TimeOpt = None,
    efa: EfaOpt = False,
    efa_devices: EfaDevicesOpt = None,
    cpus_per_rank: CpusPerRankOpt = None,
    mem_per_rank_gb: MemPerRankOpt = None,
    sbatch_options: SbatchOpt = None,
) -> None:
    """The flags every `launch` command takes (only its signature is used, by `launch_command`)."""


def _resolved(function: Callable[..., Any]) -> list[inspect.Parameter]:
    """`function`'s parameters with their annotations evaluated (typer cannot read string annotations)."""
    hints = typing.get_type_hints(function, include_extras=True)
    return [
        param.replace(annotation=hints.get(name, param.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
        for name, param in inspect.signature(function).parameters.items()
    ]


def launch_command(plan: Callable[..., LaunchPlan]) -> Callable[..., None]:
    """A typer command from a stage's `plan(<its own flags>, *, options: LaunchOptions) -> LaunchPlan`: its
    flags, then the shared ones (`launch_flags`). Flags named like a LaunchOptions field (the shared ones, a
    stage's `--shared-save-folder`) go into `options`; the plan is printed (--dry-run) or carried out."""
    own = [param for param in _resolved(plan) if param.name != "options"]
    shared = _resolved(launch_flags)
    fields = {field.name for field in dataclasses.fields(LaunchOptions)}

    def command(**values: Any) -> None:
        dry_run = values.pop("dry_run")
        chosen = {name: values.pop(name) for name in list(values) if name in fields}
        options = launch_options(chosen)
        run_cli(lambda: plan(options=options(), **values), dry_run)

    command.__signature__ = inspect.Signature([*own, *shared])  # type: ignore[attr-defined]
    command.__doc__, command.__name__ = plan.__doc__, plan.__name__
    return command


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
    """Build the plan, then print it (dry run) or carry it out; user errors exit 2 with their fix. A plan
    that is refused (no room here, a local save_folder on several nodes) is still printed whole by a dry
    run, its refusal last."""
    try:
        plan = make_plan()
        if dry_run:
            echo(describe(plan))
        if plan.refusal:
            raise LaunchError(plan.refusal)
        if dry_run:
            return
        echo(summarize(plan))
        execute(plan, echo=echo)
    except (LaunchError, ConfigError, BatchingError) as err:
        echo(f"launch error: {err}", err=True)
        raise typer.Exit(2) from None
