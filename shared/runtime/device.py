"""Device and precision for every job, resolved in one place: train (Composer's "cpu"/"gpu" and
"fp32"/"amp_bf16"), the train bench (the same names, plus a torch device to time on) and encode (a torch
device string and inference precision "fp32"/"fp16"/"bf16").

torch, never composer: encode and shared/ use it too.
"""

from __future__ import annotations

import os
import platform
import socket
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.config import ConfigError

# Inference / mixed precisions that run under torch.autocast on a GPU, by the names each stage uses.
AUTOCAST_DTYPES = {
    "amp_bf16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "amp_fp16": torch.float16,
    "fp16": torch.float16,
}


class DeviceError(ConfigError):
    """A device or precision this machine cannot give; the message names the setting to change."""


def resolve_device_kind(requested: str) -> str:
    """`device` auto|cpu|gpu -> "gpu" or "cpu" (auto: a GPU if one is visible)."""
    has_gpu = torch.cuda.is_available()
    if requested == "gpu" and not has_gpu:
        raise DeviceError("device=gpu but no CUDA device is visible; use device=auto or device=cpu")
    return "gpu" if has_gpu and requested != "cpu" else "cpu"


def nodes_in_launch(env: dict[str, str] | None = None) -> int:
    """Nodes of this job, from the launcher's environment (torchrun's WORLD_SIZE over LOCAL_WORLD_SIZE; 1
    without a launcher). No process group needed: it is read before joining one."""
    env = dict(os.environ) if env is None else env
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, world // max(1, local))


def check_node_sees_gpu(requested: str, kind: str, nodes: int, flag: str = "device=") -> None:
    """Refuse `auto` resolved to the CPU on one node of a job of several: its peers found their GPUs, most
    likely, and this node's driver is broken. A train job would pick gloo there while its peers picked NCCL
    (the process group never forms: a hang until the join timeout, then a restart into the same hang); an
    eval or an encode would run its share on CPU while every other rank waits for it. `flag` is the job's
    spelling of its device setting (`device=`, `--device `, `encoder.device=`): the message's two fixes."""
    if kind == "cpu" and requested == "auto" and nodes > 1:
        raise DeviceError(
            f"{flag}auto but this node ({socket.gethostname()}) sees no GPU, in a job of {nodes} nodes: "
            f"check its GPUs and drivers (nvidia-smi), or pass {flag}cpu for a CPU job on several nodes"
        )


def resolve_precision(requested: str, kind: str) -> str:
    """auto -> amp_bf16 on GPU, fp32 on CPU (Composer's CPU device only trains in fp32)."""
    if requested == "auto":
        return "amp_bf16" if kind == "gpu" else "fp32"
    if kind == "cpu" and requested != "fp32":
        raise DeviceError(f"precision={requested} needs a GPU; on CPU use precision=fp32 (or auto)")
    return requested


def local_cuda_device() -> torch.device:
    """This rank's GPU: torchrun / Composer's launcher set LOCAL_RANK (one GPU per rank)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def pick_torch_device(requested: str) -> torch.device:
    """encode's `encoder.device`: "auto" -> this rank's GPU if any, else CPU; else as torch reads it."""
    if requested != "auto":
        return torch.device(requested)
    return local_cuda_device() if resolve_device_kind("auto") == "gpu" else torch.device("cpu")


def autocast(device: torch.device, precision: str) -> AbstractContextManager[Any]:
    """Autocast for a mixed / low precision on a GPU; nothing on CPU (bf16 autocast there is slow and
    changes results) or for fp32."""
    if device.type == "cuda" and precision in AUTOCAST_DTYPES:
        return torch.autocast("cuda", dtype=AUTOCAST_DTYPES[precision])
    return nullcontext()


def describe_device(device: torch.device) -> str:
    """torch.cuda.get_device_name(), or a CPU description with its thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} torch threads)"


def host_cpu_name(proc_cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The host CPU's model name, read in this process: /proc/cpuinfo's first "model name" (Linux), else
    platform.processor(), else "CPU". What py-cpuinfo reports as `brand_raw`, without the Python subprocess
    py-cpuinfo starts to find it (train/loop/trainer.py gives this to Composer's env report)."""
    with suppress(OSError):
        for line in proc_cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    return platform.processor() or "CPU"


@dataclass(frozen=True)
class DeviceSetup:
    """One resolved device for a single-process job (the bench), and how the train job would run on it."""

    device: torch.device
    kind: str  # "cpu" or "gpu" (the train config's names)
    name: str  # torch.cuda.get_device_name(), or a CPU description
    precision: str  # "fp32" or "amp_bf16"
    channels_last: bool

    def autocast(self) -> AbstractContextManager[Any]:
        return autocast(self.device, self.precision)

    def sync(self) -> None:
        """Wait for queued GPU work, so a timer stopped after this measures the work itself."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def resolve_device_setup(requested: str, precision: str, channels_last: bool) -> DeviceSetup:
    """auto -> the current CUDA device if any; precision as `resolve_precision`; channels_last on GPU only."""
    kind = resolve_device_kind(requested)
    precision = resolve_precision(precision, kind)
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "gpu" else torch.device("cpu")
    return DeviceSetup(device, kind, describe_device(device), precision, channels_last and kind == "gpu")


def unused_gpus_warning(job: str, device_count: int | None = None, env: dict[str, str] | None = None) -> str:
    """A loud line when a single-process job (no launcher: no WORLD_SIZE) sees more than one GPU and so
    uses one of them; "" otherwise. `make train` / `make encode` without GPUS= run that way; the fix is to
    pass GPUS=<n> (torchrun, one process a GPU)."""
    env = dict(os.environ) if env is None else env
    count = torch.cuda.device_count() if device_count is None else device_count
    if count <= 1 or "WORLD_SIZE" in env:
        return ""
    return (
        f"WARNING: {count} GPUs are visible but this {job} runs ONE process on ONE GPU; "
        f"use all of them with `make {job} GPUS={count}` (or `python -m {job} launch --gpus {count}`)"
    )
