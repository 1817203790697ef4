"""Issue 22 (3): the trainer's gradient sync under FSDP. LeanTrainer enters FSDP's no_sync on every FSDP root
of the model for all but a step's last microbatch (`fsdp_no_sync`, default on), and not at all when the
config turns it off; the collectives this saves are counted in
tests/train/bench/test_bench_scale_counters.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from train.loop.step import LeanTrainer, accumulation_sync, fsdp_roots


@pytest.fixture
def model(one_rank_group: None) -> torch.nn.Module:
    """A ComposerModel-like parent whose children are FSDP roots (as Composer 0.32 wraps them); 1 rank."""
    parent = torch.nn.Module()
    parent.unet = FullyShardedDataParallel(torch.nn.Linear(4, 4), device_id=torch.device("cpu"))
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    parent.text = FullyShardedDataParallel(frozen, device_id=torch.device("cpu"))
    parent.head = torch.nn.Linear(4, 1)  # not wrapped: not a root
    return parent


def syncing(root: FullyShardedDataParallel) -> bool:
    return all(m._sync_gradients for m in root.modules() if isinstance(m, FullyShardedDataParallel))


def trainer_sync(model: torch.nn.Module, no_sync: bool, final: bool) -> object:
    fake = SimpleNamespace(state=SimpleNamespace(model=model), fsdp_no_sync=no_sync)
    return LeanTrainer._gradient_sync(fake, final)  # type: ignore[arg-type]


def test_trainer_skips_fsdp_gradient_sync_on_all_but_the_last_microbatch(model: torch.nn.Module) -> None:
    unet, text = model.unet, model.text
    assert fsdp_roots(model) == [unet, text]
    with trainer_sync(model, no_sync=True, final=False):  # type: ignore[attr-defined]
        assert not syncing(unet)
        assert syncing(text)  # frozen: nothing to accumulate, left alone
    assert syncing(unet)  # restored on exit
    with trainer_sync(model, no_sync=True, final=True):  # type: ignore[attr-defined]
        assert syncing(unet)  # the last microbatch reduces the sum
    with trainer_sync(model, no_sync=False, final=False):  # type: ignore[attr-defined]
        assert syncing(unet)  # fsdp_no_sync=false: Composer's every-microbatch sync
    with accumulation_sync(torch.nn.Linear(2, 2), is_final_microbatch=False):
        pass  # no FSDP: nothing to do
