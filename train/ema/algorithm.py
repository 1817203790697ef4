"""EMA of the U-Net weights: Composer's `EMA` algorithm, plus the phase handoff and weight bookkeeping.

Where the weights live (Composer 0.32):
- During a step the model holds the training weights and `EMA.ema_model` the average.
- At a checkpoint event Composer swaps them, so a checkpoint's `state["model"]` holds the EMA weights and
  the EMA algorithm's state (`ema_model.named_parameters_dict`) holds the training weights, with
  `ema_weights_active=True`. The next BATCH_START swaps them back. `select_unet_weights` reads a checkpoint
  with this in mind; export and the phase handoff both go through it.
- Names: the store keys every weight by its wrapper-independent name (`clean_name`: no `module.`,
  `_fsdp_wrapped_module.`, `_orig_mod.`), so a checkpoint resumes under any wrapper and rank count, and
  checkpoints written before that (prefixed keys) are re-keyed on load. Every update, swap and placement
  pairs all trainable parameters and buffers by name and stops the job on a mismatch (issue 15).
- Under FSDP the store is sharded like the parameters (`train/ema/sharded.py`): each rank averages its own
  shard with no communication. A sharded checkpoint (`checkpoint_format=sharded`) saves it as shards too:
  `state_dict` exposes each rank's shards as ShardedTensors (`train/ema/shards.py`) that DCP writes in
  parallel and loads back in place, resharded, with no gather. A full checkpoint (one rank, DDP, or
  `checkpoint_format=full`) holds the full EMA: gathered at the save under FSDP, sliced back into shards
  after a load (`place_loaded_store`), on any rank count.
  `ema.update_interval` (smoothing**N every N steps, same half-life) remains for cheaper updates.

Phase handoff (SD2 phase 2 at 512 px from phase 1 at 256 px): `load_path=<phase 1 checkpoint>` with
`load_weights_only=true` loads `state["model"]` — phase 1's EMA weights, since Composer saves with EMA
swapped in — into the model, with a fresh optimizer and schedule. `HandoffEMA` then seeds its average from
those same loaded weights as soon as training starts (ignoring `ema.start`), so phase 2 begins with model
= EMA = phase 1's EMA, and the EMA continues rather than restarting from a noisier copy. Phase 1's raw
training weights are not carried over.
"""

from __future__ import annotations

from typing import Any

import torch
from composer.algorithms import EMA
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from torch.distributed._shard.sharded_tensor import ShardedTensor

from train.ema.names import EMAStoreMismatchError, clean_name
from train.ema.sharded import ShardedEMAStore
from train.ema.shards import sharded_parameters
from train.ema.store import NamedEMAStore, has_fsdp

__all__ = ["EMAStoreMismatchError", "HandoffEMA", "NamedEMAStore", "build_ema", "clean_name"]

UNET_PREFIX = "unet."


def lerp_ema(model: torch.nn.Module, ema: NamedEMAStore, smoothing: float) -> None:
    """One EMA update of `ema` towards `model` (see `NamedEMAStore.lerp`)."""
    ema.lerp(model, smoothing)


class HandoffEMA(EMA):
    """Composer's EMA with a strict, wrapper-independent store and a fused update; after a weights-only
    load it starts the average from the loaded weights."""

    def __init__(self, *, seed_from_loaded_weights: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.seed_from_loaded_weights = seed_from_loaded_weights
        self.model: torch.nn.Module | None = None  # the state's model, for sharded checkpoint state
        self.sharded_checkpoints = False  # Composer's fsdp state_dict_type is "sharded"

    def attach(self, state: State) -> None:
        """Remember the model and whether checkpoints are sharded (at INIT: before any save or load)."""
        self.model = state.model
        fsdp_config = getattr(state, "fsdp_config", None)
        self.sharded_checkpoints = fsdp_config is not None and fsdp_config.state_dict_type == "sharded"

    def writes_shards(self) -> bool:
        return self.sharded_checkpoints and self.model is not None and has_fsdp(self.model)

    def sharded_checkpoint_state(self) -> dict[str, Any]:
        """This rank's EMA shards as ShardedTensors over the store (no communication). Composer asks for
        this state before a sharded load too, as the template DCP loads into: when the store is not yet
        sharded (INIT built it before FSDP wrapped the model), a sharded store over the model's current
        shards becomes the store, and the load fills it in place."""
        assert self.model is not None
        if not isinstance(self.ema_model, ShardedEMAStore):
            self.ema_model = ShardedEMAStore(self.model)
        store = self.ema_model
        return {
            "named_parameters_dict": sharded_parameters(store.named_parameters_dict, self.model),
            "named_buffers_dict": store.named_buffers_dict,  # replicated and small: DCP writes one copy
        }

    def new_store(self, model: torch.nn.Module) -> NamedEMAStore:
        """Sharded like the parameters under FSDP (no communication per update), else a plain copy."""
        return ShardedEMAStore(model) if has_fsdp(model) else NamedEMAStore(model)

    def place_loaded_store(self, model: torch.nn.Module) -> None:
        """After a load the store holds full weights (checkpoints are written gathered): under FSDP, slice
        them into this rank's shards, whatever rank count or wrapper wrote them (collective)."""
        if has_fsdp(model) and not isinstance(self.ema_model, ShardedEMAStore):
            assert isinstance(self.ema_model, NamedEMAStore)
            self.ema_model = ShardedEMAStore.from_full(self.ema_model, model)

    def _pending_seed(self, state: State) -> bool:
        return self.seed_from_loaded_weights and not self.ema_started and int(state.timestamp.batch) == 0

    def match(self, event: Event, state: State) -> bool:
        if event == self.update_event and not self.ema_started and self._should_start(state):
            # Composer would start with its own name-keyed EMAParameters here.
            self.ema_model = self.new_store(state.model)
            self.ema_started = True
        if event == Event.FIT_START and self._pending_seed(state):
            return True
        return super().match(event, state)

    def apply(self, event: Event, state: State, logger: Logger) -> Any:
        if event == Event.INIT:  # a store for checkpoint loading to fill (Composer's would be name-keyed)
            self.attach(state)
            self.ema_model = self.new_store(state.model)
            return None
        # FIT_START comes after DDP/FSDP wrapping, so the average's shards match the updates'.
        if event == Event.FIT_START and self._pending_seed(state):
            self.ema_model = self.new_store(state.model)
            self.ema_started = True
        elif event == Event.FIT_START:
            self.place_loaded_store(state.model)
        if event in (Event.BATCH_END, Event.EPOCH_END):  # the only thing Composer does on these events
            assert isinstance(self.ema_model, NamedEMAStore) and isinstance(self.smoothing, float)
            self.ema_model.lerp(state.model, self.smoothing)
            return None
        return super().apply(event, state, logger)

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors, dicts and bools under clean names (loadable by a weights-only unpickler)."""
        assert isinstance(self.ema_model, NamedEMAStore)
        ema_model = (
            self.sharded_checkpoint_state() if self.writes_shards() else self.ema_model.checkpoint_state()
        )
        return {
            **Algorithm.state_dict(self),
            "ema_model": ema_model,
            "ema_weights_active": bool(self.ema_weights_active),
            "ema_started": bool(self.ema_started),
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = False) -> None:
        state = self.ensure_compatible_state_dict(dict(state))
        if not loaded_in_place(state["ema_model"]):  # full tensors: resliced at FIT_START under FSDP
            self.ema_model = NamedEMAStore.from_checkpoint(state["ema_model"])
        self.ema_weights_active = bool(state["ema_weights_active"])
        self.ema_started = bool(state["ema_started"])


def loaded_in_place(saved: dict[str, Any]) -> bool:
    """A sharded load filled the store's own shards (the ShardedTensors of `sharded_checkpoint_state`);
    a full checkpoint's state holds plain full tensors instead."""
    return any(isinstance(v, ShardedTensor) for v in saved["named_parameters_dict"].values())


def build_ema(smoothing_per_update: float, start: str, update_interval: str, handoff: bool) -> HandoffEMA:
    return HandoffEMA(
        seed_from_loaded_weights=handoff,
        half_life=None,
        smoothing=smoothing_per_update,
        ema_start=start,
        update_interval=update_interval,
    )


def find_ema(algorithms: Any) -> EMA | None:
    return next((a for a in algorithms if isinstance(a, EMA)), None)


def _ema_state(checkpoint_state: dict[str, Any]) -> dict[str, Any] | None:
    for _name, algo_state in checkpoint_state.get("algorithms", []):
        if isinstance(algo_state, dict) and "ema_model" in algo_state:
            return algo_state
    return None


def _unet_only(weights: dict[str, Any]) -> dict[str, Any]:
    cleaned = {clean_name(k): v for k, v in weights.items()}
    return {k[len(UNET_PREFIX) :]: v for k, v in cleaned.items() if k.startswith(UNET_PREFIX)}


def select_unet_weights(checkpoint_state: dict[str, Any], which: str = "ema") -> tuple[dict[str, Any], str]:
    """The U-Net state dict a checkpoint holds: `which` = "ema" or "training"; returns (weights, what).

    `what` says what was found: "ema", "training", or "training (no EMA in checkpoint)" when asked for EMA
    weights from a run without EMA (or one saved before the average started).
    """
    model = checkpoint_state["model"]
    ema = _ema_state(checkpoint_state)
    if ema is None or not ema.get("ema_started", False):
        return _unet_only(model), "training" if which == "training" else "training (no EMA in checkpoint)"
    saved = ema["ema_model"]  # a sharded checkpoint has no entry for an empty buffer table
    stored = {**saved["named_parameters_dict"], **saved.get("named_buffers_dict", {})}
    model_has_ema = bool(ema.get("ema_weights_active", False))
    want_model = model_has_ema == (which == "ema")
    if want_model:
        return _unet_only(model), which
    merged = _unet_only(model)
    merged.update(_unet_only(stored))  # frozen params are not averaged: those come from the model
    return merged, which
