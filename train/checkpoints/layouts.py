"""Optimizer state in the memory layout of its parameter after a load (channels_last on or off).

A checkpoint keeps each tensor's strides: AdamW moments saved by a channels_last run load as NHWC tensors
whatever layout the resuming model has (`Optimizer.load_state_dict` only casts dtype and device). torch
2.7's fused AdamW on CPU (`_fused_adamw_`; not checked on CUDA) walks parameter, gradient and moments by
memory offset, so a moment whose strides differ from its parameter's updates the wrong elements: one step
at lr 0.1 on an 8x3x3x3 kernel with NHWC moments and NCHW weights lands 0.38 away from unfused AdamW,
which is right (tests/train/checkpoints/test_layouts.py).
Copying each such state tensor into its parameter's layout once, after the load, makes every layout resume
every other (tests/train/checkpoints/test_gpu_path.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def conform_optimizer_state(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Give every state tensor shaped like its parameter the parameter's strides, in place; returns how
    many were copied (0 when the layouts already agree, e.g. a resume in the same layout or under FSDP,
    whose flat shards are 1-D)."""
    copied = 0
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if not _needs_layout(value, param):
                    continue
                state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)
                copied += 1
    return copied


def _needs_layout(value: object, param: torch.Tensor) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.shape == param.shape
        and value.dim() > 1
        and value.stride() != param.stride()
    )
