"""Composer's own FSDP wrapper on CPU ranks (gloo), so `fsdp=true` runs the production path without a GPU.

Two things in Composer 0.32.1 + torch 2.7 assume the compute device is a GPU; everything else on that path
already works on CPU (Composer builds its device mesh for its device name, "cpu"; gloo carries FSDP's
all-gathers and reduce-scatters; PyTorch's FSDP takes `device_id=torch.device("cpu")`):
- Composer builds every FSDP unit with `device_id=torch.cuda.current_device()`
  (composer/distributed/dist_strategy.py `prepare_fsdp_module`), which raises on a host without CUDA.
  While the Trainer is constructed (where Composer wraps the model, `State._apply_fsdp`),
  `torch.cuda.current_device` answers the CPU device. Any other caller in that window would have failed on
  this host anyway.
- Composer gathers full state dicts with `StateDictOptions(cpu_offload=True)` (composer/core/state.py). On a
  GPU that copies each gathered tensor out to host memory; on CPU the `.cpu()` is a no-op and FSDP then frees
  or reuses the memory the "copy" still views. Seen on 2 gloo ranks: rank 0 segfaults in `clone()` at every
  full-format save (`FlatParamHandle.to_cpu` frees the gathered flat parameter), and, with that avoided, the
  full optimizer state holds `exp_avg_sq` in place of `exp_avg` for every parameter. With the model on the
  CPU there is nothing to offload, so a CPU FSDP run gathers with `cpu_offload=False`: installed for the
  rest of the process by `composer_fsdp_on_cpu` (checkpoints are saved during `fit`), or for one block by
  `no_cpu_offload` (the bench's and tests' direct Composer saves).
GPU runs are untouched by both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from composer.core import state as composer_state_module
from torch.distributed.checkpoint.state_dict import StateDictOptions


def _options_without_offload(**kwargs: Any) -> StateDictOptions:
    return StateDictOptions(**{**kwargs, "cpu_offload": False})


@contextlib.contextmanager
def no_cpu_offload() -> Iterator[None]:
    """Composer gathers FSDP state dicts without the CPU "offload" inside this block only."""
    original = composer_state_module.StateDictOptions
    composer_state_module.StateDictOptions = _options_without_offload  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        composer_state_module.StateDictOptions = original  # type: ignore[misc]


@contextlib.contextmanager
def composer_fsdp_on_cpu(device: str, fsdp: bool) -> Iterator[None]:
    """Around `Trainer(...)` of a CPU run with fsdp=true: Composer's FSDP places its units on the CPU, and
    (from here on, in this process) gathers state dicts without the CPU "offload"."""
    if device != "cpu" or not fsdp:
        yield
        return
    composer_state_module.StateDictOptions = _options_without_offload  # type: ignore[assignment,misc]
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]
