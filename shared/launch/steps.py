"""The ordered steps that start a plan's ranks: exec torchrun here, sbatch scripts, a Kubernetes manifest."""

from __future__ import annotations

import math
import shlex
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

from shared.launch.plan import (
    ARRAY_JOB_ID,
    DEFAULT_GPUS_PER_NODE,
    LaunchError,
    LaunchOptions,
    LaunchPlan,
    RankResources,
    Step,
    Topology,
    check_local_capacity,
    check_name,
    local_torchrun,
    plural,
    repo_python,
    workdir,
)
from shared.launch.specs import (
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
    secret_by_value,
)
from shared.launch.supervisor import REJOIN_TIMEOUT_S, Supervision
from shared.launch.validate import SHELL_PATH, check_options, check_value, check_values, parse_sbatch_option

# The pod annotation an Indexed Job sets to the pod's index: node rank i is pod i.
K8S_COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# The Job's uid, the same on every pod of it: the rendezvous run id (a new Job is a new run id).
K8S_JOB_UID = "metadata.labels['batch.kubernetes.io/controller-uid']"
SBATCH = ("sbatch", "--parsable")  # --parsable: print only "<job id>[;<cluster>]"
KUBECTL_APPLY = ("kubectl", "apply", "-f", "-")
K8S_DEFAULT_GRACE_S = 30  # Kubernetes' own terminationGracePeriodSeconds


# --- torchrun ---------------------------------------------------------------------------------------
def torchrun_args(
    topology: Topology,
    rdzv_host: str,
    rdzv_port: str,
    run_id: str,
    max_restarts: int,
    store_host: bool | None = None,
) -> list[str]:
    """torchrun's flags for one node of an elastic `c10d` rendezvous (values may be shell / k8s variables).
    `--nnodes=N` is N:N: a lost node's replacement joins the next round. The store lives in one agent: the
    first whose address matches the endpoint hosts it, so with nodes behind one address (the two-node test)
    losing that node took every agent's store along; `store_host` (node number known) decides instead."""
    # read_timeout: how long an agent's store client waits to reach the store (torch's default 60 s, one
    # retry): a node started two minutes before node 0 gave up, saying a lost node was never replaced.
    conf = f"join_timeout={REJOIN_TIMEOUT_S},read_timeout={REJOIN_TIMEOUT_S}"
    conf += "" if store_host is None else f",is_host={str(store_host).lower()}"
    return [
        f"--nnodes={topology.nodes}",
        f"--nproc-per-node={topology.gpus_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_host}:{rdzv_port}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={max_restarts}",
    ]


RDZV_HOST_PLACEHOLDER = "<node-0-address>"


def local_torchrun_argv(
    torchrun: str,
    topology: Topology,
    options: LaunchOptions,
    program: Sequence[str],
    run_id: str,
    max_restarts: int,
) -> list[str]:
    """One machine's torchrun command: standalone (a free port) for one node, else the elastic rendezvous
    at --master-addr (a placeholder in a plan that is refused for lack of one)."""
    if topology.nodes == 1:
        # --standalone picks a free port itself, so two local runs on one machine never collide.
        flags = ["--standalone", "--nnodes=1", f"--nproc-per-node={topology.gpus_per_node}"]
    else:
        host = options.master_addr or RDZV_HOST_PLACEHOLDER
        store_host = None if options.node_rank is None else options.node_rank == 0
        flags = torchrun_args(topology, host, str(options.master_port), run_id, max_restarts, store_host)
        if local := address_toward(options.master_addr, options.master_port):
            flags.append(f"--local-addr={local}")
    return [torchrun, *flags, "-m", *program]


def address_toward(host: str | None, port: int) -> str | None:
    """This machine's address on the route to `host`: what the other nodes reach it by. torch publishes node
    0's fully qualified hostname to the ranks as MASTER_ADDR unless told an address, and machines that reach
    each other by IP (`--master-addr 10.0.0.1`) but cannot resolve each other's names looped in 300 s start-up
    timeouts. None when there is no route (the plan is refused for lack of a --master-addr, or says so)."""
    if not host:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # UDP: picks the route, sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return None


def requeue_resources(supervision: Supervision) -> dict[str, object]:
    """#SBATCH lines for a job that saves and requeues itself: the batch shell gets USR1 `lead` seconds
    before the time limit (a backstop for the supervisor's own deadline), the job may be requeued, and its
    segments append to one log."""
    return {
        "signal": f"B:USR1@{math.ceil(supervision.deadline_lead_s)}",
        "requeue": True,
        "open-mode": "append",
    }


def _k8s_notes(plan: LaunchPlan) -> list[str]:
    target = plan.program[2]  # as the pods name it (shared/launch/plan.py program_target)
    if plan.options.launcher != "k8s" or not Path(plan.target).is_file():
        return []
    if Path(target).is_absolute():
        return [f"{target} is outside this repo: the pods read it from the image, so it must be there too"]
    return [f"the pods read {target} from the image's copy of this repo: build the image after changing it"]


def layout(topology: Topology) -> str:
    """`32 nodes x 8 GPUs`, `1 node x 1 GPU`."""
    return f"{plural(topology.nodes, 'node')} x {plural(topology.gpus_per_node, 'GPU')}"


def check_plan_values(plan: LaunchPlan) -> None:
    """Everything of the plan a script or manifest will hold (14.11: no line can be injected)."""
    check_name(plan.name)
    check_options(plan.options)
    check_values(plan.program, "the config path / key=value overrides")
    check_value(workdir(), "the repo path (run from a checkout whose path has no control characters)")
    check_value(repo_python(), "the Python interpreter path")
    if plan.options.launcher == "slurm":  # written as bare words, one inside a `bash -c '...'` body
        for path, what in ((workdir(), "the repo path"), (repo_python(), "the .venv's Python path")):
            check_value(path, what, SHELL_PATH, "a checkout and .venv under a path without spaces or quotes")


def build_steps(plan: LaunchPlan, environ: Mapping[str, str]) -> list[Step]:
    check_plan_values(plan)
    launcher = plan.options.launcher
    if launcher != "slurm" and plan.options.sbatch_options:
        raise LaunchError(f"--sbatch-option is for LAUNCHER=slurm, not {launcher}: drop it")
    if launcher == "local":
        try:
            plan.notes += check_local_capacity(plan.topology, plan.options)
        except LaunchError as err:  # the dry run still prints the plan (and this, last)
            plan.refuse(str(err))
        return [local_step(plan)]
    if launcher == "slurm":
        return slurm_array_steps(plan) if plan.job == "encode" else [slurm_nodes_step(plan)]
    plan.notes += _k8s_notes(plan)
    return [k8s_step(plan, environ)]


def torchrun_restarts(plan: LaunchPlan) -> int:
    """torchrun's own `--max-restarts`: resilience.max_restarts on several nodes (its elastic agent restarts
    every node together); 0 on one, where the supervisor restarts torchrun itself."""
    supervision = plan.supervision or Supervision()
    return supervision.max_restarts if supervision.elastic else 0


def local_step(plan: LaunchPlan) -> Step:
    argv = local_torchrun_argv(
        local_torchrun(), plan.topology, plan.options, plan.program, plan.name, torchrun_restarts(plan)
    )
    node_rank = str(plan.options.node_rank or 0)
    what = f"torchrun on this machine (node {node_rank})"
    if plan.topology.nodes > 1:
        what = "torchrun on this machine, one node of the elastic rendezvous (run it on every node)"
    if plan.supervision is not None:
        what += ", supervised by this launch process (save on SIGTERM / SIGUSR1, restarts, hang watchdog)"
    return Step(what, tuple(argv), env={"NODE_RANK": node_rank})


def _title(plan: LaunchPlan, layout: str) -> str:
    return f"sd-pretrain {plan.job} {plan.target}: {layout}"


def _sbatch_header(plan: LaunchPlan, layout: str, name: str, resources: Mapping[str, object]) -> SbatchHeader:
    options = plan.options
    extra = tuple(parse_sbatch_option(option) for option in options.sbatch_options)
    site = SlurmSite(options.partition, options.account, options.time_limit, extra)
    env_block = render_env_exports(load_env_vars(options.efa))
    return SbatchHeader(_title(plan, layout), name, resources, site, env_block, workdir())


def slurm_nodes_step(plan: LaunchPlan) -> Step:
    """One sbatch script: `nodes` whole nodes, torchrun on each, rendezvous at the first."""
    topo, options = plan.topology, plan.options
    torchrun = check_value(slurm_torchrun(), "the torchrun path")
    supervision = plan.supervision or Supervision()
    flags = torchrun_args(topo, "$MASTER_ADDR", "$MASTER_PORT", "$RDZV_ID", torchrun_restarts(plan))
    values = {
        "python": shlex.quote(repo_python()),
        "supervise_flags": shlex.join(supervision.flags()),
        "lead_s": f"{supervision.deadline_lead_s:g}",
        "max_requeues": plan.max_requeues,
        "nodes": topo.nodes,
        "layout": layout(topo),
        "master_port": options.master_port,
        "torchrun": shlex.quote(torchrun),
        "torchrun_flags": inside_single_quotes(flags),
        "program": shlex.join(plan.program),
    }
    resources = {**node_resources(topo, part_of_node(plan)), **requeue_resources(supervision)}
    header = _sbatch_header(plan, layout(topo), plan.name, resources)
    script = render_sbatch(SLURM_NODES, header, values)
    return Step("the sbatch script", SBATCH, stdin=script, file_name=f"{plan.name}.sbatch")


def part_of_node(plan: LaunchPlan) -> RankResources | None:
    """A job of fewer GPUs than a node holds asks for its ranks' CPUs and memory and leaves the rest of the
    node to other jobs; several nodes, or all of one, are taken whole (and the per-rank flags say so)."""
    topo, options = plan.topology, plan.options
    node_gpus = options.gpus_per_node or DEFAULT_GPUS_PER_NODE
    if topo.nodes == 1 and topo.gpus_per_node < node_gpus and plan.resources is not None:
        return plan.resources.for_ranks(topo.gpus_per_node)
    if options.cpus_per_rank or options.mem_per_rank_gb:
        plan.notes.append(
            f"{layout(topo)}: the sbatch job takes whole nodes (--exclusive, all their CPUs and memory), so "
            "--cpus-per-rank / --mem-per-rank-gb do not change what it asks for"
        )
    return None


def inside_single_quotes(args: list[str]) -> str:
    """Words for a `bash -c '...'` body: a word naming a variable ($MASTER_ADDR) in double quotes, so the
    task's shell expands it; the others quoted as usual (already checked: no quote characters)."""
    return " ".join(f'"{arg}"' if "$" in arg else shlex.quote(arg) for arg in args)


def slurm_torchrun() -> str:
    """torchrun as Slurm nodes run it: this environment's, on the filesystem every node mounts."""
    return local_torchrun()


def slurm_array_steps(plan: LaunchPlan) -> list[Step]:
    """An array of one-GPU encode ranks, then a finalize job that waits for all of them to succeed."""
    world, python = plan.topology.world_size, shlex.quote(repo_python())
    if plan.resources is None:
        raise LaunchError("an encode array needs per-rank resources; plan_encode sets them")
    resources = array_resources(world, plan.resources)
    array_header = _sbatch_header(plan, f"{plural(world, 'array task')} x 1 GPU", plan.name, resources)
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
    """A headless Service + Indexed Job: pod i runs torchrun, rendezvous (c10d) hosted at pod 0."""
    topo, options = plan.topology, plan.options
    master = f"{plan.name}-0.{plan.name}"
    # $(RDZV_ID) is expanded by Kubernetes from the env entry below (the Job's uid).
    flags = torchrun_args(topo, master, str(options.master_port), "$(RDZV_ID)", torchrun_restarts(plan))
    supervision = plan.supervision or Supervision()
    supervise = ["python", "-m", "shared.launch.supervise", *supervision.flags(), "--"]
    # Kubernetes expands $(VAR) in a command and reads $$ as $: the program's words stay literal.
    command = [*supervise, "torchrun", *flags, "-m", *(word.replace("$", "$$") for word in plan.program)]
    env = [
        {"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": K8S_COMPLETION_INDEX}}},
        {"name": "RDZV_ID", "valueFrom": {"fieldRef": {"fieldPath": K8S_JOB_UID}}},
    ]
    env_vars = load_env_vars(options.efa)
    env += render_env_entries(env_vars, environ, options.secret)
    for name in secret_by_value(env_vars, environ):
        plan.notes.append(
            f"{name} holds a user:password, so pods read it from the Secret {options.secret}, not the "
            f"manifest: kubectl create secret generic {options.secret} --from-literal={name}=... (with AWS_*)"
        )
    node = plan.resources.for_ranks(topo.gpus_per_node) if plan.resources else None
    manifest = render_k8s_job(
        _title(plan, layout(topo)),
        plan.name,
        plan.job,
        topo,
        command,
        env,
        str(options.image),
        options.namespace,
        options.master_port,
        node,
        grace_s=max(K8S_DEFAULT_GRACE_S, math.ceil(supervision.deadline_lead_s)),
        efa_devices=options.efa_devices,
    )
    return Step("the Kubernetes manifest", KUBECTL_APPLY, stdin=manifest, file_name=f"{plan.name}.yaml")
