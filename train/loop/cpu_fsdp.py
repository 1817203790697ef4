"""Composer's own FSDP wrapper on CPU ranks (gloo), so `fsdp=true` runs the production path without a GPU.

Two things in Composer 0.32.1 + torch 2.7 assume the compute device is a GPU; everything else on that path
already works on CPU (Composer builds its device mesh for its device name, "cpu"; gloo carries FSDP's
all-gathers and reduce-scatters; PyTorch's FSDP takes `device_id=torch.device("cpu")`):
- Composer builds every FSDP unit with `device_id=torch.cuda.current_device()`
  (composer/distributed/dist_strategy.py `prepare_fsdp_module`), which raises on a host without CUDA. While
  the Trainer is constructed (where Composer wraps the model, `State._apply_fsdp`) on a CPU run,
  `torch.cuda.current_device` answers the CPU device. Any other caller in that window would have failed on
  this host anyway.
- Composer gathers full checkpoints with `cpu_offload=True`, and FSDP's `FlatParamHandle.to_cpu` moves the
  gathered flat parameter to the CPU (`.to("cpu")`, a no-op when it is there already) and then frees the
  gathered storage, which on CPU is the storage the parameters still view: every rank-0 full save
  segfaults in `clone()` (torch/distributed/fsdp/_flat_param.py `to_cpu`; seen on 2 gloo ranks). Where the
  flat parameter is already on the CPU there is nothing to offload, so `to_cpu` leaves it as it is.
GPU runs are untouched by both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.fsdp._flat_param import FlatParamHandle

_GPU_TO_CPU = FlatParamHandle.to_cpu


@contextlib.contextmanager
def _to_cpu_unless_there(handle: FlatParamHandle) -> Iterator[Any]:
    if handle.flat_param.device.type == "cpu":
        yield
        return
    with _GPU_TO_CPU(handle):
        yield


@contextlib.contextmanager
def composer_fsdp_on_cpu(device: str, fsdp: bool) -> Iterator[None]:
    """Around `Trainer(...)`: Composer's FSDP places units on the CPU on a CPU run with fsdp=true, and
    (for the rest of the process) full-checkpoint gathers keep CPU flat parameters alive."""
    if device != "cpu" or not fsdp:
        yield
        return
    FlatParamHandle.to_cpu = _to_cpu_unless_there  # type: ignore[assignment,method-assign]
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]
