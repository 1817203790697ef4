"""EMA sharded like the parameters under FSDP: each rank averages its own shard, with no communication.

Composer's EMA summons the full parameters on every update: at SD2-base shapes that all-gathers ~3.5 GB of
fp32 weights per step on every rank and averages all of them redundantly (issue 11). With
`use_orig_params=True`, FSDP's parameters are, outside forward and backward, 1-D views into the rank's own
shard of the flat parameter (empty on ranks that hold none of it). The store keeps a clone of exactly those
views, so the update, the swap for checkpoints and sample grids, and the placement all stay local.

The full weights are gathered only for a checkpoint (`checkpoint_state`: the same clean-name, full-tensor
layout as the unsharded store, so a checkpoint resumes on any rank count, with or without FSDP) and sliced
back into shards after a load (`from_full`, through FSDP's own `summon_full_params(writeback=True)`), which
is the resharding.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp._runtime_utils import _reshard  # private: see drop_gathered_copies

from train.ema.names import EMAStoreMismatchError, paired
from train.ema.store import NamedEMAStore, cloned_weights

FLAT_PARAM_MARKER = "_flat_param"  # the name FSDP gives its flat parameters when use_orig_params=False


def check_orig_params(model: torch.nn.Module) -> None:
    names = [name for name, _ in model.named_parameters() if FLAT_PARAM_MARKER in name]
    if names:
        raise EMAStoreMismatchError(
            f"the sharded EMA needs FSDP's original parameters, but the model exposes {names[0]}; set "
            "use_orig_params=True in the FSDP config (train/loop/trainer.py parallelism_config)"
        )


def drop_gathered_copies(model: torch.nn.Module) -> None:
    """Free the gathered weights FSDP kept from a forward without backward; no communication.

    Under SHARD_GRAD_OP a forward that no backward follows (a sample grid) leaves each unit's gathered
    weights allocated, and the next unshard reuses them without all-gathering (torch 2.7
    `FlatParamHandle.needs_unshard` only checks that the storage is allocated). Once the EMA has written
    into the shards those copies are stale: the next training forward would run on the EMA weights and a
    checkpoint gather would save them as the training weights. Freeing them makes the next unshard gather
    the shards as they are now.
    """
    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):
            handle = module._handle
            if handle is not None and handle.uses_sharded_strategy and not handle.needs_unshard():
                _reshard(module, handle, free_unsharded_flat_param=True)


class ShardedEMAStore(NamedEMAStore):
    """The average of this rank's shard of every trainable parameter (and the replicated buffers)."""

    def __init__(self, model: torch.nn.Module | None = None):
        super().__init__(None)
        self.model = model
        if model is not None:
            check_orig_params(model)
            self.named_parameters_dict, self.named_buffers_dict = cloned_weights(model)

    def pairs(self, model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(local shard, stored shard) by clean name; a shape mismatch means the model is not sharded now
        (inside summon_full_params or between forward and backward), where a local swap would be wrong."""
        pairs = super().pairs(model)
        for live, stored in pairs:
            if live.shape != stored.shape:
                raise EMAStoreMismatchError(
                    f"sharded EMA: a parameter has shape {tuple(live.shape)} in the model but "
                    f"{tuple(stored.shape)} in the EMA shard; the EMA can only swap or update between steps, "
                    "when FSDP holds its parameters sharded"
                )
        return pairs

    def lerp(self, model: torch.nn.Module, smoothing: float) -> None:
        """Each rank updates its own shards in place; the pairing is kept as in `NamedEMAStore`."""
        with torch.no_grad():
            plan = self.lerp_plan(model)
            if any(a.shape != b.shape for a, b in zip(plan.averages, plan.current, strict=True)):
                self.pairs(model)  # not sharded now (see `pairs`): raises, naming the shapes
            plan.run(smoothing)

    def swap_params(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for live, stored in self.pairs(model):
                held = live.detach().clone()
                live.copy_(stored)
                stored.copy_(held)
        drop_gathered_copies(model)

    def transfer_ema_params(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for live, stored in self.pairs(model):
                live.copy_(stored)
        drop_gathered_copies(model)

    def move_params_to_device(self, destination_model: torch.nn.Module) -> None:
        self.model = destination_model
        for live, stored in self.pairs(destination_model):
            if stored.device != live.device:
                raise EMAStoreMismatchError(
                    f"sharded EMA on {stored.device} but the model's shards on {live.device}; "
                    "build the store after FSDP has placed the model"
                )

    @classmethod
    def from_full(cls, full: NamedEMAStore, model: torch.nn.Module) -> ShardedEMAStore:
        """Slice a full-weight store (a checkpoint from any rank count or wrapper) into this rank's shards.

        Collective: every rank calls it at the same point (FIT_START)."""
        check_orig_params(model)
        held = cls(model)  # the model's own shards, put back below
        with torch.no_grad():
            with FullyShardedDataParallel.summon_full_params(model, writeback=True):
                for live, stored in full.pairs(model):
                    live.copy_(stored.to(live.device))
            store = cls(model)  # now the stored weights, sharded like the model
            held.transfer_ema_params(model)
        return store

    def checkpoint_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The full EMA tensors under clean names, as the unsharded store saves them.

        Collective: Composer builds the checkpoint state on every rank. The gather puts the stored shards
        into the model's shards, lets FSDP gather them, then puts the model's own shards back."""
        if self.model is None:
            raise EMAStoreMismatchError("sharded EMA: no model attached to gather the checkpoint from")
        return gather_full(self, self.model)


def gather_full(store: ShardedEMAStore, model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    held = ShardedEMAStore(model)
    with torch.no_grad():
        store.transfer_ema_params(model)
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            params, buffers = cloned_weights(model)
        held.transfer_ema_params(model)
    paired(params.items(), store.named_parameters_dict, "trainable parameters")  # same names both ways
    return {"named_parameters_dict": params, "named_buffers_dict": buffers}
