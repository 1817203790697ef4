"""Launch plans: how many nodes and ranks a train or encode job gets, and the commands that start them.

A plan is pure data derived from the request (`--gpus 256 --launcher slurm`) and the job's config: the
node layout, the batch split (train), and the ordered steps that launch it (exec torchrun, submit sbatch
scripts, apply a Kubernetes manifest). `--dry-run` prints a plan (shared/launch/report.py);
shared/launch/submit.py executes one.

Every path starts ranks with torchrun (part of torch, so the encode side never needs composer). One node:
`--standalone`. Several nodes: torchrun's elastic agent with a `c10d` rendezvous hosted at the first node
(`--rdzv-endpoint`), a run id per job and attempt, and `--max-restarts`: when any rank on any node fails,
every node's agent stops its ranks and they all meet again in a new rendezvous round (a lost node's
replacement joins it, waiting up to REJOIN_TIMEOUT_S). Composer and MosaicML Streaming read what torchrun
sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK); the ranks take
NODE_RANK (Composer's per-node file names) from the rendezvous' GROUP_RANK (shared/launch/control.py).

This module imports nothing heavy (no torch at import, never composer): encode launches go through it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from shared.batching import Batching
from shared.config import REPO_ROOT
from shared.launch.supervisor import Supervision

Launcher = Literal["local", "slurm", "k8s"]
LAUNCHERS: tuple[str, ...] = ("local", "slurm", "k8s")
AUTO = "auto"  # LAUNCHER=auto: local for one node, else the scheduler found on this machine (pick_launcher)
JobKind = Literal["train", "encode"]

DEFAULT_GPUS_PER_NODE = 8  # DGX / p4d / p5 / a3 nodes
DEFAULT_MASTER_PORT = 29500  # torchrun's own default
GPU_DRIVER_PATHS = (Path("/proc/driver/nvidia"), Path("/dev/kfd"))  # NVIDIA's; AMD's (ROCm, torch.cuda too)
KUBECTL_TIMEOUT_S = 10  # `kubectl config current-context` only reads the kubeconfig
# Kubernetes object names are DNS labels (63 chars); Indexed Job pods append "-<index>" to the job name.
MAX_NAME_CHARS = 50
# Written into argv where a later step needs the job id an earlier `sbatch --parsable` printed.
ARRAY_JOB_ID = "<array-job-id>"


class LaunchError(ValueError):
    """A launch request that cannot work as asked; the message names the fix."""


@dataclass(frozen=True)
class Topology:
    """How the requested GPUs are laid out: `nodes` machines with `gpus_per_node` ranks each."""

    nodes: int
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def derive_topology(gpus: int, nodes: int | None = None, gpus_per_node: int | None = None) -> Topology:
    """E.g. 256 GPUs -> 32 nodes x 8; 4 GPUs -> 1 node x 4; 16 GPUs with nodes=4 -> 4 nodes x 4."""
    given = {"GPUS": gpus, "NODES": nodes, "GPUS_PER_NODE": gpus_per_node}
    bad = [f"{name}={value}" for name, value in given.items() if value is not None and value < 1]
    if bad:  # name only what the user gave: a NODES=None they never typed reads as a bug
        raise LaunchError(f"{', '.join(bad)}: must be >= 1 (e.g. GPUS=1 for one rank on this machine)")
    if nodes is not None:
        if gpus % nodes:
            raise LaunchError(f"GPUS={gpus} does not split evenly over NODES={nodes}; use a multiple of it")
        per_node = gpus // nodes
        if gpus_per_node is not None and gpus_per_node != per_node:
            raise LaunchError(
                f"GPUS={gpus} over NODES={nodes} is {per_node} per node, not GPUS_PER_NODE={gpus_per_node}; "
                f"drop one of the three or use GPUS={nodes * gpus_per_node}"
            )
        return Topology(nodes, per_node)
    per_node = gpus_per_node or DEFAULT_GPUS_PER_NODE
    if gpus <= per_node:
        return Topology(1, gpus)
    if gpus % per_node:
        lower, upper = gpus - gpus % per_node, gpus - gpus % per_node + per_node
        raise LaunchError(
            f"GPUS={gpus} is not a multiple of {per_node} GPUs per node; use GPUS={lower} or {upper}, or set "
            "NODES / --gpus-per-node to match your machines"
        )
    return Topology(gpus // per_node, per_node)


@dataclass
class LaunchOptions:
    """Everything a launch takes besides the job itself; one CLI flag per field."""

    gpus: int = 1
    launcher: str = "local"
    nodes: int | None = None  # None: gpus / gpus_per_node
    gpus_per_node: int | None = None  # None: DEFAULT_GPUS_PER_NODE (or all of `gpus` when fewer)
    # local multi-node without a scheduler: the same command on every machine, own node rank, node 0's host
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    name: str | None = None  # Slurm job / Kubernetes object name; None: sd-<job>-<config>
    image: str | None = None  # k8s: a container image with this repo installed (`pip install -e .`)
    namespace: str | None = None  # k8s: None means kubectl's current namespace
    secret: str = "sd-pretrain-env"  # k8s: Secret holding AWS_* / HF_TOKEN (optional: pods start without it)
    partition: str | None = None  # slurm
    account: str | None = None  # slurm
    time_limit: str | None = None  # slurm --time, e.g. 3-00:00:00
    efa: bool = False  # add the AWS EFA libfabric knobs (p4d / p5 nodes) from jobs/launch/env.yaml
    efa_devices: int | None = None  # k8s with efa: EFA interfaces per pod (p4d.24xlarge: 4, p5.48xlarge: 32)
    # Per rank (an encode array task, or one GPU's share of a node): None derives them from the job's config
    # (data loader workers + the rank's own process; the job's documented memory estimate).
    cpus_per_rank: int | None = None
    mem_per_rank_gb: int | None = None
    # Extra sbatch options written as `#SBATCH --key=value` into every script (`qos=high`, `requeue`).
    sbatch_options: list[str] = field(default_factory=list)
    # The user asserts that a local save_folder is one path every node mounts (NFS, Lustre): a local
    # save_folder on several nodes is refused without it (each node would hold part of every checkpoint).
    shared_save_folder: bool = False
    # Why LAUNCHER=auto picked `launcher` (shown in the plan); "" when the launcher was named.
    picked: str = ""

    def __post_init__(self) -> None:
        if self.launcher == AUTO:
            self.launcher, self.picked = pick_launcher(self)
        if self.launcher not in LAUNCHERS:
            raise LaunchError(f"LAUNCHER={self.launcher!r} is not one of {', '.join((AUTO, *LAUNCHERS))}")
        if self.launcher == "k8s" and not self.image:
            raise LaunchError(
                "the k8s launcher needs a container image with this repo installed: pass --image "
                "registry/sd-pretrain:tag (make: IMAGE=...)"
            )
        if self.launcher != "local" and (self.node_rank is not None or self.master_addr):
            raise LaunchError(
                f"--node-rank / --master-addr are for the local launcher; {self.launcher} picks the "
                "rendezvous host itself: drop them"
            )
        if not 0 < self.master_port < 1 << 16:
            raise LaunchError(f"--master-port {self.master_port} is not a TCP port (1-65535)")
        for flag, value in (
            ("--cpus-per-rank", self.cpus_per_rank),
            ("--mem-per-rank-gb", self.mem_per_rank_gb),
        ):
            if value is not None and value < 1:
                raise LaunchError(f"{flag} {value} must be >= 1 (or left out to derive it from the config)")

    def topology(self) -> Topology:
        return derive_topology(self.gpus, self.nodes, self.gpus_per_node)


def pick_launcher(options: LaunchOptions) -> tuple[str, str]:
    """LAUNCHER=auto: (launcher, why). One node, or a local multi-node run (--master-addr): local. Several
    nodes: Slurm where `sbatch` is on PATH, else Kubernetes where kubectl has a current context, else local
    (whose plan then says the nodes do not fit here)."""
    nodes = derive_topology(options.gpus, options.nodes, options.gpus_per_node).nodes
    if nodes == 1 or options.node_rank is not None or options.master_addr:
        return "local", ""
    many = plural(nodes, "node")
    if shutil.which("sbatch"):
        return "slurm", f"{many} and `sbatch` is on PATH{unused_master_addr()}"
    context = kube_context()
    if context:
        return "k8s", f"{many} and kubectl's current context is {context!r}{unused_master_addr()}"
    return "local", ""


def unused_master_addr() -> str:
    """A clause for a plan of several nodes run without --master-addr while MASTER_ADDR is in the
    environment (torchrun, a container or a site profile leaves it there; the Makefile passes it only with
    NODE_RANK or from its command line): that it was not used, and how to make this machine a node."""
    addr = os.environ.get("MASTER_ADDR")
    if not addr:
        return ""
    return (
        f"; MASTER_ADDR={addr} in the environment is not used alone: for this machine as one node of a "
        "hand-launched run pass NODE_RANK too, or MASTER_ADDR=.. on make's command line (--master-addr)"
    )


def kube_context() -> str | None:
    """kubectl's current context, or None without kubectl or without a context."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    try:
        done = subprocess.run(
            [kubectl, "config", "current-context"],
            capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() if done.returncode == 0 else "") or None


@dataclass(frozen=True)
class RankResources:
    """What one rank asks the scheduler for besides its GPU: CPUs and host memory (GiB)."""

    cpus: int
    memory_gb: int
    basis: str  # how they were derived, shown in the plan

    def for_ranks(self, ranks: int) -> RankResources:
        return RankResources(self.cpus * ranks, self.memory_gb * ranks, self.basis)


def rank_resources(options: LaunchOptions, workers: int, base_gb: int, gb_per_worker: int) -> RankResources:
    """CPUs = data workers + the rank's own process; memory = base + per worker; flags override either."""
    cpus = options.cpus_per_rank or workers + 1
    memory = options.mem_per_rank_gb or base_gb + gb_per_worker * workers
    basis = (
        f"{plural(workers, 'data worker')} + the rank; {base_gb} GiB + {gb_per_worker} GiB per worker; "
        "--cpus-per-rank / --mem-per-rank-gb override"
    )
    return RankResources(cpus, memory, basis)


def plural(count: int, noun: str, nouns: str = "") -> str:
    """`1 node`, `32 nodes`, `2 microbatches` (pass the plural where it is not noun + s)."""
    return f"{count} {noun}" if count == 1 else f"{count} {nouns or noun + 's'}"


@dataclass(frozen=True)
class Step:
    """One command a launch runs; steps run in order and a failing one stops the rest."""

    what: str  # one line for the dry-run and the log
    argv: tuple[str, ...]
    stdin: str | None = None  # a rendered sbatch script or manifest
    env: Mapping[str, str] = field(default_factory=dict)  # added to the launching environment
    file_name: str | None = None  # what the stdin spec would be called on disk (dry-run header)


@dataclass
class LaunchPlan:
    """A fully derived launch: what runs where, and the steps that start it."""

    job: JobKind
    target: str  # the train config or dataset name as given
    options: LaunchOptions
    topology: Topology
    program: tuple[str, ...]  # python -m <program...>: what every rank runs
    steps: list[Step] = field(default_factory=list)
    batching: Batching | None = None  # train only
    memory: str | None = None  # train only: the microbatch against the GPU type's memory (shared/estimate)
    finalize: str | None = None  # encode only: how the index merge runs once all ranks are done
    estimate: str | None = None  # train only: time/cost of the run being launched (shared/estimate)
    reference: list[str] = field(default_factory=list)  # train: another recipe's numbers, not this run's
    resources: RankResources | None = None  # per rank; None: the scheduler's defaults
    cluster: list[str] = field(default_factory=list)  # train only: communication / checkpoint lines
    notes: list[str] = field(default_factory=list)
    # train only: how each node's supervisor restarts and stops the ranks (shared/launch/supervisor.py);
    # None: torchrun runs bare (encode). `max_requeues`: Slurm requeues after a resumable stop.
    supervision: Supervision | None = None
    max_requeues: int = 0
    # Where each node keeps what is its own (a Streaming cache, the control folder, ...): one line each.
    node_local: list[str] = field(default_factory=list)
    # Why this plan cannot be carried out, each naming its fix; a dry run still prints the whole plan.
    refusals: list[str] = field(default_factory=list)

    def refuse(self, reason: str) -> None:
        """Record a reason the plan cannot run; the launch stops with them, a dry run prints them last."""
        self.refusals.append(reason)

    @property
    def refusal(self) -> str | None:
        return "; and ".join(self.refusals) or None

    @property
    def name(self) -> str:
        return self.options.name or job_name(self.job, self.target)


def job_name(job: str, target: str) -> str:
    """A DNS-label-safe default name: `sd-train-sd2-base-256`."""
    stem = Path(target).stem if target.endswith((".yaml", ".yml")) else target
    slug = re.sub(r"[^a-z0-9]+", "-", f"sd-{job}-{stem}".lower()).strip("-")
    return slug[:MAX_NAME_CHARS].rstrip("-")


def check_name(name: str) -> str:
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > MAX_NAME_CHARS:
        raise LaunchError(
            f"job name {name!r} must be lowercase letters, digits and '-', start with a letter and have at "
            f"most {MAX_NAME_CHARS} characters (Kubernetes and Slurm both show it): pass --name my-run"
        )
    return name


# --- the job ----------------------------------------------------------------------------------------
def program_target(name_or_path: str) -> str:
    """A config as the ranks name it: a name stays; a file in this repo its path from the repo root, which
    a Slurm task (shared checkout) and a pod (the image's copy) resolve alike; else its absolute path."""
    path = Path(name_or_path)
    if not path.is_file():
        return name_or_path
    path = path.resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


# --- this machine ------------------------------------------------------------------------------------
def local_gpu_count() -> int:
    """GPUs torch would use here; with no GPU driver loaded none, and torch (~2 s a launch) stays out."""
    if not any(path.exists() for path in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_local_capacity(topology: Topology, options: LaunchOptions) -> list[str]:
    """Refuse a local launch this machine cannot hold; returns notes for the plan."""
    if topology.nodes > 1 and not options.master_addr:
        nodes = topology.nodes
        raise LaunchError(
            f"{nodes} nodes do not fit on this machine: use LAUNCHER=slurm or LAUNCHER=k8s (LAUNCHER=auto "
            "picks one where `sbatch` or `kubectl` is on PATH), or run the same command on each of the "
            f"{nodes} machines with MASTER_ADDR=<node 0's address> (make: MASTER_ADDR=..)"
            + unused_master_addr()
        )
    if options.node_rank is not None and not 0 <= options.node_rank < topology.nodes:
        raise LaunchError(f"NODE_RANK={options.node_rank} must be in 0..{topology.nodes - 1}")
    gpus_here = local_gpu_count()
    per_node = topology.gpus_per_node
    if gpus_here and per_node > gpus_here:
        raise LaunchError(
            f"{per_node} GPUs per node requested but this machine has {gpus_here}: use GPUS={gpus_here} "
            f"(or NODES to spread the run), or LAUNCHER=slurm / k8s"
        )
    if not gpus_here:
        cores = os.cpu_count() or 1
        if per_node > cores:
            raise LaunchError(
                f"no GPU here, so the local launcher runs {per_node} CPU ranks on gloo, but this machine has "
                f"{cores} CPU cores: use GPUS={cores} or fewer, or LAUNCHER=slurm / k8s"
            )
        return [f"no GPU on this machine: {plural(per_node, 'CPU rank')} on gloo"]
    return []


def local_torchrun() -> str:
    """The torchrun next to this interpreter (the project's .venv), else the one on PATH."""
    beside = Path(sys.executable).parent / "torchrun"
    if beside.exists():
        return str(beside)
    found = shutil.which("torchrun")
    if not found:
        raise LaunchError(
            "torchrun not found next to this Python or on PATH: it ships with torch; run `make install` "
            "or activate the environment that has torch"
        )
    return found


def repo_python() -> str:
    """The interpreter Slurm tasks run: this one, which cluster nodes see on the shared filesystem."""
    return sys.executable


def workdir() -> str:
    return str(REPO_ROOT)
