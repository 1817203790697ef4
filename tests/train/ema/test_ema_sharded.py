"""The EMA under FSDP stays sharded like the parameters (issue 11 item 2) and its checkpoint reshards
(issue 15 item 4), on 2 CPU ranks with PyTorch's own FSDP over gloo (Composer's FSDP wrapper needs CUDA).

One spawn of 2 ranks checks, driving `HandoffEMA` through the events Composer sends it:
(a) an update, and the swap at a checkpoint, move 0 bytes through collectives (a summon_full_params in the
    same counter moves the whole model: the counter sees FSDP's traffic);
(b) the gathered EMA equals the EMA an unsharded store computes on the same weights;
(c) its checkpoint state (full, gathered at save) resumes on 2 FSDP ranks and on a 1-rank FSDP group, and a
    1-rank unsharded checkpoint resumes on 2 FSDP ranks; the main process resumes it on 1 rank without FSDP.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from composer.core import Event
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from train.ema.algorithm import HandoffEMA, build_ema
from train.ema.names import EMAStoreMismatchError
from train.ema.sharded import ShardedEMAStore
from train.ema.store import NamedEMAStore, cloned_weights
from train.loop.comm_counter import count_collectives

STEPS = 3
SMOOTHING = 0.8
RANKS = 2


class Net(nn.Module):
    """Uneven sizes, so some ranks hold none of a parameter (empty shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.unet = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 2))
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unet(x) * self.scale


def wrap(model: nn.Module, group: Any = None) -> FullyShardedDataParallel:
    def each_linear(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or isinstance(module, nn.Linear)

    return FullyShardedDataParallel(
        model, process_group=group, device_id=torch.device("cpu"), auto_wrap_policy=each_linear,
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, use_orig_params=True,
    )  # fmt: skip


def fresh_ema() -> HandoffEMA:
    return build_ema(SMOOTHING, "0ba", "1ba", handoff=False)


def event(ema: HandoffEMA, name: Event, model: nn.Module) -> None:
    ema.apply(name, SimpleNamespace(model=model), logger=None)  # type: ignore[arg-type]


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    with FullyShardedDataParallel.summon_full_params(model, writeback=False):
        return cloned_weights(model)[0]


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0.0, atol=atol), k


def gathered_state(saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    return saved["ema_model"]["named_parameters_dict"]


def gathered(ema: HandoffEMA) -> dict[str, torch.Tensor]:
    return gathered_state(ema.state_dict())


def rank_main(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    torch.manual_seed(0)
    model = wrap(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ema = fresh_ema()
    event(ema, Event.INIT, model)
    ema.ema_started = True
    assert isinstance(ema.ema_model, ShardedEMAStore)
    reference = NamedEMAStore()
    reference.named_parameters_dict = full_weights(model)  # the average as 1 unsharded rank keeps it
    for step in range(STEPS):
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with count_collectives() as update:
            event(ema, Event.BATCH_END, model)
        assert update.total_calls == 0 and update.bytes == 0, update  # (a)
        current = full_weights(model)
        for name, avg in reference.named_parameters_dict.items():
            avg.lerp_(current[name], 1.0 - SMOOTHING)
    with count_collectives() as swap:
        ema._ensure_ema_weights_active(SimpleNamespace(model=model))  # type: ignore[arg-type]
        ema._ensure_training_weights_active(SimpleNamespace(model=model))  # type: ignore[arg-type]
    assert swap.total_calls == 0, swap
    # Sample grids swap the EMA in around a no-grad forward, which leaves FSDP's gathered copies behind:
    # after the swap back, a gather (and the next forward) must see the training weights, not the EMA.
    training = full_weights(model)
    ema.ema_model.swap_params(model)
    with torch.no_grad():
        model(torch.randn(2, 5))
    ema.ema_model.swap_params(model)
    assert_equal(full_weights(model), training)
    with count_collectives() as gather:  # positive control: the counter sees FSDP's all-gathers
        full_weights(model)
    assert gather.total_calls > 0 and gather.bytes > 0, gather  # gloo: all_gather per FSDP unit

    saved = ema.state_dict()  # collective on every rank, as Composer saves
    assert_equal(saved["ema_model"]["named_parameters_dict"], reference.named_parameters_dict, 1e-6)  # (b)
    assert not any(k.startswith(("module.", "_fsdp")) for k in saved["ema_model"]["named_parameters_dict"])
    if rank == 0:
        torch.save(saved, Path(out) / "ema_state.pt")
        torch.save(reference.named_parameters_dict, Path(out) / "reference.pt")

    # (c) resume on 2 FSDP ranks, into a model with other weights, which the resharding leaves alone
    torch.manual_seed(1)
    other = wrap(Net())
    before = full_weights(other)
    resumed = fresh_ema()
    resumed.load_state_dict(saved)
    event(resumed, Event.FIT_START, other)
    assert isinstance(resumed.ema_model, ShardedEMAStore)
    assert_equal(full_weights(other), before)
    assert_equal(
        resumed.state_dict()["ema_model"]["named_parameters_dict"],
        saved["ema_model"]["named_parameters_dict"],
    )

    # ... a 1-rank unsharded checkpoint on 2 FSDP ranks
    from_one = fresh_ema()
    from_one.load_state_dict(
        {
            **saved,
            "ema_model": {
                "named_parameters_dict": reference.named_parameters_dict,
                "named_buffers_dict": {"scale": torch.ones(2)},
            },
        }
    )
    event(from_one, Event.FIT_START, other)
    assert_equal(gathered(from_one), reference.named_parameters_dict)

    # ... and a 2-rank checkpoint on a 1-rank FSDP group (resharding to another rank count)
    solo = dist.new_group([0])
    if rank == 0:
        alone = wrap(Net(), group=solo)
        on_one = fresh_ema()
        on_one.load_state_dict(saved)
        event(on_one, Event.FIT_START, alone)
        assert_equal(
            on_one.state_dict()["ema_model"]["named_parameters_dict"],
            saved["ema_model"]["named_parameters_dict"],
        )
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.dist
@pytest.mark.slow
def test_sharded_ema_moves_no_bytes_per_update_and_its_checkpoint_resumes_on_any_rank_count(
    tmp_path: Path,
) -> None:
    mp.spawn(rank_main, args=(free_port(), str(tmp_path)), nprocs=RANKS, join=True)
    saved = torch.load(tmp_path / "ema_state.pt", weights_only=True)
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    # resume on 1 rank without FSDP: the full store, strict by name against the unwrapped model
    ema = fresh_ema()
    ema.load_state_dict(saved)
    model = Net()
    event(ema, Event.FIT_START, model)
    assert isinstance(ema.ema_model, NamedEMAStore) and not isinstance(ema.ema_model, ShardedEMAStore)
    assert_equal(ema.ema_model.named_parameters_dict, reference, 1e-6)
    ema.ema_model.swap_params(model)
    assert torch.allclose(model.unet[0].weight, reference["unet.0.weight"], atol=1e-6)


def test_sharded_ema_refuses_a_model_without_original_parameters() -> None:
    flat = SimpleNamespace(named_parameters=lambda: [("_fsdp_wrapped_module._flat_param", torch.zeros(3))])
    with pytest.raises(EMAStoreMismatchError, match="use_orig_params=True"):
        ShardedEMAStore(flat)  # type: ignore[arg-type]
