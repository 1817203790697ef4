"""Composer's own FSDP wrapper on CPU ranks (gloo), so `fsdp=true` runs the production path without a GPU.

Composer 0.32.1 builds every FSDP unit with `device_id=torch.cuda.current_device()`
(composer/distributed/dist_strategy.py `prepare_fsdp_module`), which raises on a host without CUDA.
Everything else on that path already works on CPU: the device mesh is built for Composer's device name
("cpu"), gloo carries FSDP's all-gathers and reduce-scatters, and PyTorch's FSDP takes
`device_id=torch.device("cpu")`. So while the Trainer is constructed (where Composer wraps the model, in
`State._apply_fsdp`) on a CPU run, `torch.cuda.current_device` answers the CPU device. Any other caller in
that window would have failed on this host anyway, and GPU runs are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def composer_fsdp_on_cpu(device: str, fsdp: bool) -> Iterator[None]:
    """Around `Trainer(...)`: Composer's FSDP places units on the CPU on a CPU run with fsdp=true."""
    if device != "cpu" or not fsdp:
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]
