"""Every value the launcher writes into an sbatch script or a Kubernetes manifest passes one validator here.

A newline in `--partition` would add a line to the sbatch script, and sbatch stops reading `#SBATCH` lines
at the first line that is not one, so every later option would be silently ignored; a newline in a program
argument or an environment value could do the same to a manifest or a script body. So: no control
characters anywhere, a charset per field where the field has an obvious one, and the message names the
flag to change. Credentials never ride in URLs the launcher writes or prints (`scheme://user:pass@host`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from shared.launch.plan import LaunchError, LaunchOptions
from shared.storage import redact_url

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_URL_USERINFO = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s@]+@")

# Per-field charsets. Slurm names (partition lists, accounts, QOS, ...) are letters, digits, `_.-` and commas;
# a time limit is digits with `-` and `:` (`3-00:00:00`, `90`, `1:30:00`).
SLURM_NAME = re.compile(r"[A-Za-z0-9_.,-]+")
SLURM_TIME = re.compile(r"[0-9:-]+")
# Kubernetes: a namespace is an RFC 1123 label, a Secret name an RFC 1123 subdomain.
RFC1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
RFC1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
# An OCI image reference: registry/path:tag or @sha256:digest.
IMAGE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*")
HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]*")
# A path a Slurm script names as a bare shell word (the repo, its Python): no spaces, quotes or `$`.
SHELL_PATH = re.compile(r"[A-Za-z0-9_./+@%:,=~-]+")
# An extra sbatch option `--key=value`: the key is a long option name, the value one word that sbatch's own
# #SBATCH parser reads literally (no quotes, backslashes or whitespace; no `{` `}`, the templates' syntax).
SBATCH_KEY = re.compile(r"[a-z][a-z0-9-]*")
SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.,:/=@%+&|!*^~()\[\]-]+")
# Options the launcher writes itself: a second copy would fight the plan (Slurm takes the last one).
MANAGED_SBATCH_KEYS = frozenset(
    {
        "job-name", "nodes", "ntasks", "ntasks-per-node", "gpus", "gpus-per-node", "array", "chdir",
        "output", "error", "export", "exclusive", "cpus-per-task", "mem", "partition", "account", "time",
        "dependency", "parsable",
    }
)  # fmt: skip
SBATCH_FLAG_FOR = {
    "cpus-per-task": "--cpus-per-rank",
    "mem": "--mem-per-rank-gb",
    "partition": "--partition",
    "account": "--account",
    "time": "--time",
}


def check_value(value: str, flag: str, charset: re.Pattern[str] | None = None, example: str = "") -> str:
    """`value` unchanged, or a LaunchError naming `flag`: no control characters, and `charset` if given."""
    text = str(value)
    if _CONTROL.search(text):
        raise LaunchError(
            f"{flag} {text!r} contains a control character (newline, tab, ...): it would add lines to the "
            f"generated job spec; pass {flag} without it"
        )
    if charset is not None and not charset.fullmatch(text):
        hint = f", e.g. {example}" if example else ""
        raise LaunchError(
            f"{flag} {text!r} has characters a job spec cannot hold; use {charset.pattern}{hint}"
        )
    if _URL_USERINFO.search(text):
        raise LaunchError(
            f"{flag} carries a user/password inside a URL ({redact_url(text)}): the launcher writes "
            "this into job specs; pass credentials through the environment (AWS_* / the k8s Secret) instead"
        )
    return text


def check_values(values: Iterable[str], flag: str) -> None:
    for value in values:
        check_value(value, flag)


def has_userinfo(text: str) -> bool:
    return bool(_URL_USERINFO.search(text))


def parse_sbatch_option(option: str) -> tuple[str, str | bool]:
    """`qos=high` / `--qos=high` -> ("qos", "high"); `requeue` -> ("requeue", True); refuses injection."""
    flag = "--sbatch-option"
    check_value(option, flag)
    key, sep, value = option.removeprefix("--").partition("=")
    if not SBATCH_KEY.fullmatch(key):
        raise LaunchError(f"{flag} {option!r}: {key!r} is not an sbatch long option name (e.g. qos=high)")
    if key in MANAGED_SBATCH_KEYS:
        own = SBATCH_FLAG_FOR.get(key)
        fix = f"use {own}" if own else "the launcher sets it from the plan; drop it"
        raise LaunchError(f"{flag} {option!r}: --{key} is written by the launcher itself: {fix}")
    if not sep:
        return key, True
    check_value(value, f"{flag} {key}=", SBATCH_VALUE, "qos=high, constraint=a100|h100, gres=gpu:a100:8")
    return key, value


def check_options(options: LaunchOptions) -> None:
    """Every launch flag that ends up in a script or manifest, with the flag named in the refusal."""
    if options.partition is not None:
        check_value(options.partition, "--partition", SLURM_NAME, "gpu or gpu,gpu-long")
    if options.account is not None:
        check_value(options.account, "--account", SLURM_NAME, "ml-team")
    if options.time_limit is not None:
        check_value(options.time_limit, "--time", SLURM_TIME, "3-00:00:00")
    if options.image is not None:
        check_value(options.image, "--image", IMAGE_REF, "registry.example.com/sd-pretrain:1.0")
    if options.namespace is not None:
        check_value(options.namespace, "--namespace", RFC1123_LABEL, "ml-training")
    check_value(options.secret, "--secret", RFC1123_SUBDOMAIN, "sd-pretrain-env")
    if options.master_addr is not None:
        check_value(options.master_addr, "--master-addr", HOST, "10.0.0.5 or node-0.cluster")
    for option in options.sbatch_options:
        parse_sbatch_option(option)
    check_efa_devices(options)


def check_efa_devices(options: LaunchOptions) -> None:
    """A pod sees an EFA interface only if it asks the device plugin for it (`vpc.amazonaws.com/efa`), and
    how many a node has depends on its instance type; with the EFA knobs but no devices, NCCL finds no EFA
    provider. Slurm and local ranks use the devices their node has."""
    devices = options.efa_devices
    if devices is None:
        if options.efa and options.launcher == "k8s":
            raise LaunchError(
                "--efa on Kubernetes needs --efa-devices N, the EFA interfaces each pod asks for "
                "(make: EFA_DEVICES=N; 4 on p4d.24xlarge, 32 on p5.48xlarge)"
            )
        return
    if options.launcher != "k8s":
        raise LaunchError(
            f"--efa-devices is for Kubernetes pods; {options.launcher} ranks use the EFA devices their node "
            "has: drop it"
        )
    if not options.efa:
        raise LaunchError("--efa-devices without --efa: add --efa (make: EFA=1) for the EFA knobs")
    if devices < 1:
        raise LaunchError(f"--efa-devices {devices} must be >= 1 (4 on p4d.24xlarge, 32 on p5.48xlarge)")
