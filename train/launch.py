"""Launch train or encode ranks at scale: on this machine (torchrun), on Slurm (sbatch) or on Kubernetes.

    python -m train launch --gpus 256 --launcher slurm --config sd2-base-256 [--dry-run] [key=value ...]
    python -m train.launch encode laion400m --gpus 64 --launcher slurm [--dry-run] [key=value ...]

`plan_train` / `plan_encode` derive a `LaunchPlan` (nodes, ranks, batch split, the rendered specs), `describe`
prints it, `execute` carries it out. torchrun starts the ranks on every path (see train/launch_plan.py for
why). Encode launches never import composer: this module, launch_plan and launch_specs import nothing heavy,
and `python -m train.launch encode ...` reaches them without the train CLI.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from shared import storage
from shared.config import ConfigError
from train.batching import Batching, BatchingError, derive_batching
from train.launch_plan import (
    ARRAY_JOB_ID,
    DEFAULT_MASTER_PORT,
    LaunchError,
    LaunchOptions,
    LaunchPlan,
    Step,
    check_local_capacity,
    check_name,
    derive_topology,
    load_encode_config,
    load_train_config,
    local_torchrun,
    local_torchrun_argv,
    program_target,
    repo_python,
    torchrun_args,
    workdir,
)
from train.launch_specs import (
    SLURM_ARRAY,
    SLURM_FINALIZE,
    SLURM_NODES,
    SbatchHeader,
    SlurmSite,
    array_resources,
    finalize_resources,
    load_env_vars,
    node_resources,
    render_env_entries,
    render_env_exports,
    render_k8s_job,
    render_sbatch,
)

DEFAULT_GPU_TYPE = "A100-40GB"  # the planner's reference GPU (jobs/estimate/sd2-base.yaml)
# The pod annotation an Indexed Job sets to the pod's index: node rank i is pod i.
K8S_COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
SBATCH = ("sbatch", "--parsable")  # --parsable: print only "<job id>[;<cluster>]"
KUBECTL_APPLY = ("kubectl", "apply", "-f", "-")
# What to do when a cluster binary is missing from PATH.
BINARY_FIXES = {
    "sbatch": "run this on a Slurm login node, or add --dry-run and submit the printed script yourself",
    "kubectl": "install kubectl and point it at the cluster (kubectl config use-context ...), or add "
    "--dry-run and `kubectl apply -f` the printed manifest yourself",
}
FINALIZE_IN_BAND = "rank 0 publishes the dataset version after a barrier once every rank is done (encode run)"
FINALIZE_DEPENDENT = (
    f"a dependent job (sbatch --dependency=afterok:{ARRAY_JOB_ID}) runs `encode finalize` once every array "
    "task succeeded"
)


# --- plans -------------------------------------------------------------------------------------------


def plan_train(
    config: str,
    overrides: Sequence[str] = (),
    options: LaunchOptions | None = None,
    environ: Mapping[str, str] | None = None,
    gpu_type: str = DEFAULT_GPU_TYPE,
) -> LaunchPlan:
    """The launch of `python -m train fit CONFIG overrides...` on `options.gpus` ranks."""
    options = options or LaunchOptions()
    cfg = load_train_config(config, overrides)
    topology = options.topology()
    program = ("train", "fit", program_target(config), *overrides)
    plan = LaunchPlan("train", config, options, topology, program)
    plan.steps = _steps(plan, os.environ if environ is None else environ)  # checks this machine (local)
    plan.batching = derive_batching(cfg.global_batch_size, topology.world_size, cfg.device_microbatch_size)
    plan.estimate = estimate_line(topology.world_size, gpu_type)
    return plan


def plan_encode(
    dataset: str,
    overrides: Sequence[str] = (),
    options: LaunchOptions | None = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """The launch of `python -m encode run DATASET overrides...` on `options.gpus` ranks, then finalize."""
    options = options or LaunchOptions()
    cfg = load_encode_config(dataset, overrides)
    program = ("encode", "run", program_target(dataset), *overrides)
    if options.launcher == "slurm":
        # An array task per rank: Slurm places the one-GPU tasks wherever GPUs are free.
        topology, finalize = derive_topology(options.gpus, gpus_per_node=1), FINALIZE_DEPENDENT
    else:
        topology, finalize = options.topology(), FINALIZE_IN_BAND
    plan = LaunchPlan("encode", dataset, options, topology, program, finalize=finalize)
    if options.launcher == "slurm" and options.nodes:
        plan.notes.append("NODES is ignored for an encode array: Slurm packs the one-GPU tasks onto nodes")
    if options.launcher == "k8s" and not all(storage.is_s3(uri) for uri in (cfg.source.uri, cfg.output.uri)):
        plan.notes.append(
            "source.uri / output.uri are local paths: every pod needs them mounted (or use s3://)"
        )
    plan.steps = _steps(plan, os.environ if environ is None else environ)
    return plan


def _k8s_notes(plan: LaunchPlan) -> list[str]:
    if plan.options.launcher == "k8s" and Path(plan.target).is_file():
        return [f"{plan.target} is a local file: the pods read it from the image, so it must be there too"]
    return []


def _steps(plan: LaunchPlan, environ: Mapping[str, str]) -> list[Step]:
    check_name(plan.name)
    launcher = plan.options.launcher
    if launcher == "local":
        plan.notes += check_local_capacity(plan.topology, plan.options)
        return [local_step(plan)]
    if launcher == "slurm":
        return slurm_array_steps(plan) if plan.job == "encode" else [slurm_nodes_step(plan)]
    plan.notes += _k8s_notes(plan)
    return [k8s_step(plan, environ)]


def local_step(plan: LaunchPlan) -> Step:
    argv = local_torchrun_argv(local_torchrun(), plan.topology, plan.options, plan.program)
    node_rank = str(plan.options.node_rank or 0)
    return Step(f"torchrun on this machine (node {node_rank})", tuple(argv), env={"NODE_RANK": node_rank})


def _title(plan: LaunchPlan, layout: str) -> str:
    return f"sd-pretrain {plan.job} {plan.target}: {layout}"


def _sbatch_header(plan: LaunchPlan, layout: str, name: str, resources: Mapping[str, object]) -> SbatchHeader:
    options = plan.options
    site = SlurmSite(options.partition, options.account, options.time_limit)
    env_block = render_env_exports(load_env_vars(options.efa))
    return SbatchHeader(_title(plan, layout), name, resources, site, env_block, workdir())


def slurm_nodes_step(plan: LaunchPlan) -> Step:
    """One sbatch script: `nodes` whole nodes, torchrun on each, rendezvous at the first."""
    topo, options = plan.topology, plan.options
    values = {
        "nodes": topo.nodes,
        "gpus_per_node": topo.gpus_per_node,
        "master_port": options.master_port,
        "torchrun": shlex.quote(slurm_torchrun()),
        "program": shlex.join(plan.program),
    }
    layout = f"{topo.nodes} nodes x {topo.gpus_per_node} GPUs"
    header = _sbatch_header(plan, layout, plan.name, node_resources(topo))
    script = render_sbatch(SLURM_NODES, header, values)
    return Step("the sbatch script", SBATCH, stdin=script, file_name=f"{plan.name}.sbatch")


def slurm_torchrun() -> str:
    """torchrun as Slurm nodes run it: this environment's, on the filesystem every node mounts."""
    return local_torchrun()


def slurm_array_steps(plan: LaunchPlan) -> list[Step]:
    """An array of one-GPU encode ranks, then a finalize job that waits for all of them to succeed."""
    world, python = plan.topology.world_size, shlex.quote(repo_python())
    array_header = _sbatch_header(plan, f"{world} array tasks x 1 GPU", plan.name, array_resources(world))
    array_values = {"world_size": world, "python": python, "program": shlex.join(plan.program)}
    ranks = render_sbatch(SLURM_ARRAY, array_header, array_values)
    finalize_name = f"{plan.name}-finalize"
    finalize_program = shlex.join(("encode", "finalize", *plan.program[2:]))
    after_all = "finalize after every rank succeeded"
    finalize_header = _sbatch_header(plan, after_all, finalize_name, finalize_resources())
    finalize = render_sbatch(SLURM_FINALIZE, finalize_header, {"python": python, "program": finalize_program})
    return [
        Step("the encode array", SBATCH, stdin=ranks, file_name=f"{plan.name}.sbatch"),
        Step(
            "the finalize job",
            (*SBATCH, f"--dependency=afterok:{ARRAY_JOB_ID}", "--kill-on-invalid-dep=yes"),
            stdin=finalize,
            file_name=f"{finalize_name}.sbatch",
        ),
    ]


def k8s_step(plan: LaunchPlan, environ: Mapping[str, str]) -> Step:
    """A headless Service + Indexed Job: pod i runs torchrun as node i, rendezvous at pod 0."""
    topo, options = plan.topology, plan.options
    master = f"{plan.name}-0.{plan.name}"
    # $(NODE_RANK) is expanded by Kubernetes from the env entry below (the pod's completion index).
    flags = torchrun_args(topo, "$(NODE_RANK)", master, str(options.master_port))
    command = ["torchrun", *flags, "-m", *plan.program]
    env = [{"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": K8S_COMPLETION_INDEX}}}]
    env += render_env_entries(load_env_vars(options.efa), environ, options.secret)
    manifest = render_k8s_job(
        _title(plan, f"{topo.nodes} nodes x {topo.gpus_per_node} GPUs"),
        plan.name,
        plan.job,
        topo,
        command,
        env,
        str(options.image),
        options.namespace,
        options.master_port,
    )
    return Step("the Kubernetes manifest", KUBECTL_APPLY, stdin=manifest, file_name=f"{plan.name}.yaml")


def estimate_line(gpus: int, gpu_type: str) -> str | None:
    """The planner's one-line time/cost summary for the SD2 schedule, when train/estimate.py is there."""
    try:
        from train.estimate import estimate_for_plan
    except ImportError:
        return None
    try:
        summary = estimate_for_plan(gpus, gpu_type).summary()
    except (ConfigError, OSError) as err:
        return f"unavailable ({err})"
    return f"full SD2-base schedule (jobs/estimate/sd2-base.yaml): {summary}"


# --- showing a plan ----------------------------------------------------------------------------------


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
    rows = [("launcher", plan.options.launcher), ("layout", _layout(plan))]
    if plan.batching:
        rows.append(("batch", _batch_line(plan.batching)))
    rows.append(("every rank runs", "python -m " + shlex.join(plan.program)))
    if plan.finalize:
        rows.append(("finalize", plan.finalize))
    if plan.estimate:
        rows.append(("estimate", plan.estimate))
    rows += [("note", note) for note in plan.notes]
    width = max(len(key) for key, _ in rows)
    lines = [f"launch plan: {plan.job} {plan.target} ({plan.name})"]
    lines += [f"  {key.ljust(width)}  {value}" for key, value in rows]
    return "\n".join(lines)


def _batch_line(b: Batching) -> str:
    return (
        f"global {b.global_batch} = {b.world_size} ranks x {b.per_rank_batch} per rank; "
        f"microbatch {b.microbatch} x {b.grad_accum} accumulation steps"
    )


def _layout(plan: LaunchPlan) -> str:
    topo = plan.topology
    if plan.job == "encode" and plan.options.launcher == "slurm":
        return f"{topo.world_size} array tasks x 1 GPU (world size {topo.world_size})"
    return f"{topo.nodes} node(s) x {topo.gpus_per_node} GPUs (world size {topo.world_size})"


def _shell_line(step: Step) -> str:
    env = "".join(f"{key}={shlex.quote(value)} " for key, value in step.env.items())
    stdin = f" < {step.file_name}" if step.stdin is not None else ""
    return env + shlex.join(step.argv) + stdin


# --- carrying a plan out -----------------------------------------------------------------------------


def execute(plan: LaunchPlan, echo: Callable[[str], None] = print) -> None:
    """Run the plan's steps. Local: becomes torchrun (never returns). Else: submits and reports the ids."""
    require_binaries(plan)
    if plan.options.launcher == "local":
        exec_step(plan.steps[0])
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
    """Replace this process with the step's command, so signals (Ctrl-C, a kill) reach torchrun directly."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(step.argv[0], list(step.argv), {**os.environ, **step.env})


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


# --- the CLI -----------------------------------------------------------------------------------------


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
GpuTypeOpt = Annotated[str, typer.Option("--gpu-type", help="GPU type for the cost estimate line")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="key=value overrides for the job's config")]


def launch_command(
    overrides: OverridesArg = None,
    config: Annotated[str, typer.Option("--config", help="a name in jobs/train/ or a YAML path")] = "tiny",
    gpus: GpusOpt = 1,
    nodes: NodesOpt = None,
    gpus_per_node: PerNodeOpt = None,
    launcher: LauncherOpt = LauncherChoice.local,
    dry_run: DryRunOpt = False,
    gpu_type: GpuTypeOpt = DEFAULT_GPU_TYPE,
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
) -> None:
    """Train on GPUS ranks: torchrun here, an sbatch job on Slurm, or an Indexed Job on Kubernetes."""
    options = _launch_options(locals())
    _run_cli(lambda: plan_train(config, overrides or [], options(), gpu_type=gpu_type), dry_run)


def encode_launch_command(
    dataset: Annotated[str, typer.Argument(help="a name in jobs/datasets/ or a YAML path")],
    overrides: OverridesArg = None,
    gpus: GpusOpt = 1,
    nodes: NodesOpt = None,
    gpus_per_node: PerNodeOpt = None,
    launcher: LauncherOpt = LauncherChoice.local,
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
) -> None:
    """Encode DATASET on GPUS ranks, then publish it once every rank is done (Slurm: a dependent job)."""
    options = _launch_options(locals())
    _run_cli(lambda: plan_encode(dataset, overrides or [], options()), dry_run)


def _launch_options(params: Mapping[str, object]) -> Callable[[], LaunchOptions]:
    """LaunchOptions from a command's parameters of the same names (built inside the error handler)."""
    names = {f.name for f in dataclasses.fields(LaunchOptions)}
    chosen = {name: value for name, value in params.items() if name in names}
    chosen["launcher"] = str(chosen["launcher"])
    return lambda: LaunchOptions(**chosen)  # type: ignore[arg-type]


def _run_cli(make_plan: Callable[[], LaunchPlan], dry_run: bool) -> None:
    """Build the plan, then print it (dry run) or carry it out; user errors exit 2 with their fix."""
    try:
        plan = make_plan()
        if dry_run:
            typer.echo(describe(plan))
            return
        typer.echo(summarize(plan))
        execute(plan, echo=typer.echo)
    except (LaunchError, ConfigError, BatchingError) as err:
        typer.echo(f"launch error: {err}", err=True)
        raise typer.Exit(2) from None


app = typer.Typer(add_completion=False, no_args_is_help=True, help="Launch train or encode ranks at scale.")
app.command("train")(launch_command)
app.command("encode")(encode_launch_command)


def main() -> None:
    app(prog_name="python -m train.launch")


if __name__ == "__main__":
    main()
