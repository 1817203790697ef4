"""Render the job specs in jobs/launch/ (sbatch scripts, a Kubernetes manifest) from a launch plan.

Templates use `{{name}}` placeholders (`$VAR` in shell scripts needs no escaping). A placeholder alone on
its line takes a multi-line value, indented to match; an empty value there drops the line. Placeholders are
filled in one pass, so a value that itself contains `{{...}}` is written as it is, never filled again. The
environment block comes from jobs/launch/env.yaml and is rendered once per spec: as `export` lines for
Slurm, as `env:` entries for Kubernetes.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shared.config import JOBS_DIR
from shared.launch.plan import LaunchError, RankResources, Topology
from shared.launch.validate import check_value, has_userinfo

TEMPLATES_DIR = JOBS_DIR / "launch"
ENV_FILE = TEMPLATES_DIR / "env.yaml"
SLURM_OUTER = "slurm.sbatch"
SLURM_NODES = "slurm-nodes.sh"
SLURM_ARRAY = "slurm-array.sh"
SLURM_FINALIZE = "slurm-finalize.sh"
K8S_JOB = "k8s-indexed-job.yaml"
ENV_GROUPS = ("knobs", "efa", "passthrough")
# Slurm log files, in the job's working directory: one per job, one per array task (%A: array id, %a: index).
JOB_LOG = "slurm-%x-%j.out"
ARRAY_LOG = "slurm-%x-%A_%a.out"
# The finalize job loads the encoders as an encode rank does (the empty caption's embedding, the weights'
# fingerprints: encode/launch.py's 8 GiB base), reads every partition's done-marker (tens of thousands for
# LAION) and writes the merged indexes and the manifest. 4 GiB left SD2's text tower and VAE no room.
FINALIZE_CPUS = 2
FINALIZE_MEM_GB = 16
# Kubernetes: container restarts allowed per node before the Job is marked failed.
K8S_RESTARTS_PER_NODE = 3
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_.,:/^+=@-]*")
# A placeholder alone on its line (a block: indented line by line, its line dropped when empty), or inline.
_PLACEHOLDER = re.compile(
    r"^(?P<indent>[ \t]*)\{\{(?P<block>[a-z_]+)\}\}[ \t]*(?:\n|\Z)|\{\{(?P<inline>[a-z_]+)\}\}", re.MULTILINE
)


def render_template(text: str, values: Mapping[str, Any]) -> str:
    """Fill `text` in one pass; a block placeholder alone on a line is indented (or dropped if empty)."""
    missing = sorted({m["block"] or m["inline"] for m in _PLACEHOLDER.finditer(text)} - set(values))
    if missing or "{{" in _PLACEHOLDER.sub("", text):
        raise LaunchError(f"a template in {TEMPLATES_DIR} has a placeholder no plan fills: {missing or '{{'}")

    def fill(match: re.Match[str]) -> str:
        if match["inline"]:
            return str(values[match["inline"]])
        value = str(values[match["block"]])
        if not value.strip():
            return ""
        end = "\n" if match[0].endswith("\n") else ""
        return "\n".join(match["indent"] + line if line else line for line in value.splitlines()) + end

    return _PLACEHOLDER.sub(fill, text)


def load_template(name: str) -> str:
    path = TEMPLATES_DIR / name
    if not path.is_file():
        raise LaunchError(f"launch template {path} is missing; restore it from git")
    return path.read_text()


# --- the shared environment ----------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvVar:
    """One variable from jobs/launch/env.yaml."""

    name: str
    group: str  # knobs | efa | passthrough
    doc: str
    default: str | None = None  # None for passthrough variables
    secret: bool = False


def load_env_vars(efa: bool, path: Path = ENV_FILE) -> list[EnvVar]:
    """The variables a launch sets, in file order (the efa group only when asked for)."""
    raw = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(raw) - set(ENV_GROUPS))
    if unknown:
        raise LaunchError(f"{path}: unknown section(s) {unknown}; known: {', '.join(ENV_GROUPS)}")
    out = []
    for group in ENV_GROUPS:
        if group == "efa" and not efa:
            continue
        for name, spec in (raw.get(group) or {}).items():
            out.append(_env_var(path, group, name, spec or {}))
    return out


def _env_var(path: Path, group: str, name: str, spec: Mapping[str, Any]) -> EnvVar:
    default = spec.get("default")
    if (group == "passthrough") != (default is None):
        raise LaunchError(f"{path}: {name}: passthrough variables take no default, all others need one")
    if default is not None and not _SAFE_VALUE.fullmatch(str(default)):
        raise LaunchError(f"{path}: {name}: default {default!r} has characters a shell would interpret")
    value = None if default is None else str(default)
    return EnvVar(name, group, str(spec.get("doc", "")), value, bool(spec.get("secret", False)))


def render_env_exports(env_vars: Sequence[EnvVar]) -> str:
    """Bash: a documented `export NAME="${NAME:-default}"` per knob, the passthrough ones as a comment."""
    lines = ["# Environment (jobs/launch/env.yaml); a value set in the submitting shell wins."]
    for var in env_vars:
        if var.default is not None:
            lines += [f"# {var.doc}", f'export {var.name}="${{{var.name}:-{var.default}}}"']
    passed = [var for var in env_vars if var.default is None]
    if passed:
        width = max(len(var.name) for var in passed)
        lines.append("# Passed through from the submitting shell when set there (never written here):")
        lines += [f"#   {var.name.ljust(width)}  {var.doc}" for var in passed]
    return "\n".join(lines)


def secret_by_value(env_vars: Sequence[EnvVar], environ: Mapping[str, str]) -> list[str]:
    """Plain passthroughs whose value here holds a password (`http://user:pass@host`): read from Secret."""
    return [var.name for var in env_vars if not var.secret and has_userinfo(environ.get(var.name, ""))]


def render_env_entries(env_vars: Sequence[EnvVar], environ: Mapping[str, str], secret: str) -> list[dict]:
    """Kubernetes `env:` entries: knobs and plain passthroughs by value, secrets from an optional Secret.

    A plain passthrough whose value carries userinfo is never copied into the manifest (anyone who can read
    the Job could read the password): it is read from the Secret like the credentials.
    """
    entries: list[dict[str, Any]] = []
    from_secret = set(secret_by_value(env_vars, environ))
    for var in env_vars:
        if var.secret or var.name in from_secret:
            ref = {"name": secret, "key": var.name, "optional": True}
            entries.append({"name": var.name, "valueFrom": {"secretKeyRef": ref}})
        elif var.default is not None or var.name in environ:
            value = check_value(environ.get(var.name, var.default or ""), f"environment variable {var.name}")
            entries.append({"name": var.name, "value": value})
    return entries


# --- Slurm -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmSite:
    """Cluster-specific #SBATCH settings; only those given are written."""

    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    extra: tuple[tuple[str, str | bool], ...] = ()  # --sbatch-option key=value / key, already validated

    def lines(self) -> str:
        pairs = [("partition", self.partition), ("account", self.account), ("time", self.time_limit)]
        given = [(key, value) for key, value in pairs if value]
        return "\n".join(_sbatch_line(key, value) for key, value in [*given, *self.extra])


@dataclass(frozen=True)
class SbatchHeader:
    """What the shared part of an sbatch script says: name, resources, site settings, environment."""

    title: str  # one line on top of the script
    name: str  # --job-name
    resources: Mapping[str, Any]  # #SBATCH option -> value (True: a bare flag)
    site: SlurmSite
    env_block: str  # render_env_exports(...)
    workdir: str  # --chdir: the repo on the shared filesystem


def render_sbatch(body_template: str, header: SbatchHeader, values: Mapping[str, Any]) -> str:
    """One sbatch script: the shared header and environment around a job-specific body."""
    body = render_template(load_template(body_template), {"name": header.name, **values})
    resource_lines = "\n".join(_sbatch_line(key, value) for key, value in header.resources.items())
    outer = {
        "title": header.title,
        "body_template": f"jobs/launch/{body_template}",
        "name": header.name,
        "resource_lines": resource_lines,
        "site_lines": header.site.lines(),
        "workdir": shlex.quote(header.workdir),
        "log_pattern": ARRAY_LOG if "array" in header.resources else JOB_LOG,
        "env_block": header.env_block,
        "body": body,
    }
    return render_template(load_template(SLURM_OUTER), outer)


def _sbatch_line(key: str, value: Any) -> str:
    return f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={value}"


def node_resources(topology: Topology, part_of_node: RankResources | None = None) -> dict[str, Any]:
    """#SBATCH lines for a torchrun job: one task (one torchrun) a node, on whole nodes; or, for a job of
    part of one node (`part_of_node`: its ranks' CPUs and memory), just those, sharing the node.

    `--mem=0` asks for all of each node's memory: with --exclusive alone, a site that sets DefMemPerCPU
    would give the job only that much per CPU.
    """
    lines: dict[str, Any] = {
        "nodes": topology.nodes,
        "ntasks-per-node": 1,
        "gpus-per-node": topology.gpus_per_node,
    }
    if part_of_node is not None:
        return {**lines, "cpus-per-task": part_of_node.cpus, "mem": f"{part_of_node.memory_gb}G"}
    return {**lines, "exclusive": True, "mem": 0}


def array_resources(world_size: int, resources: RankResources) -> dict[str, Any]:
    """#SBATCH lines for one array task per encode rank: one GPU, its CPUs and memory (Slurm's G = GiB).

    Asking for memory matters: on a site without DefMemPerCPU a task without `--mem` gets the whole node.
    """
    return {
        "array": f"0-{world_size - 1}",
        "ntasks": 1,
        "gpus": 1,
        "cpus-per-task": resources.cpus,
        "mem": f"{resources.memory_gb}G",
    }


def finalize_resources() -> dict[str, Any]:
    return {"ntasks": 1, "cpus-per-task": FINALIZE_CPUS, "mem": f"{FINALIZE_MEM_GB}G"}


# --- Kubernetes -----------------------------------------------------------------------------------------
EFA_RESOURCE = "vpc.amazonaws.com/efa"  # what the AWS EFA device plugin offers a pod


def render_k8s_job(
    title: str,
    name: str,
    job: str,
    topology: Topology,
    command: Sequence[str],
    env_entries: Sequence[Mapping[str, Any]],
    image: str,
    namespace: str | None,
    master_port: int,
    node: RankResources | None = None,
    grace_s: int = 30,
    efa_devices: int | None = None,
) -> str:
    """The headless Service + Indexed Job manifest (two YAML documents); `node`: one pod's requests."""
    values = {
        "title": title,
        "name": name,
        "job": job,
        "namespace_line": f"namespace: {json.dumps(namespace)}" if namespace else "",
        "nodes": topology.nodes,
        "image": json.dumps(image),
        "command": _yaml_block(list(command)),
        "env": _yaml_block(list(env_entries)),
        "resources": _yaml_block(k8s_resources(topology.gpus_per_node, node, efa_devices)),
        "master_port": master_port,
        "backoff_limit": K8S_RESTARTS_PER_NODE * topology.nodes,
        "grace_s": grace_s,
    }
    return render_template(load_template(K8S_JOB), values)


def k8s_resources(gpus: int, node: RankResources | None, efa_devices: int | None = None) -> dict[str, Any]:
    """A pod's `resources:`: its GPUs (and EFA interfaces), and CPU / memory requests so the scheduler places
    it where they fit."""
    out: dict[str, Any] = {"limits": {"nvidia.com/gpu": gpus}}
    if efa_devices:
        out["limits"][EFA_RESOURCE] = efa_devices
    if node is not None:
        out["requests"] = {"cpu": str(node.cpus), "memory": f"{node.memory_gb}Gi"}
    return out


def _yaml_block(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=False, sort_keys=False, width=1 << 16).rstrip("\n")
