"""EMA of the U-Net weights: Composer's `EMA` algorithm, plus the phase handoff and weight bookkeeping.

Where the weights live (Composer 0.32):
- During a step the model holds the training weights and `EMA.ema_model` the average.
- At a checkpoint event Composer swaps them, so a checkpoint's `state["model"]` holds the EMA weights and
  the EMA algorithm's state (`ema_model.named_parameters_dict`) holds the training weights, with
  `ema_weights_active=True`. The next BATCH_START swaps them back. `select_unet_weights` reads a checkpoint
  with this in mind; export and the phase handoff both go through it.
- Under FSDP, Composer's EMA calls `summon_full_params` on every update, so each rank all-gathers the whole
  model and averages all of it (and keeps a full-size EMA copy) every step. We do not re-implement sharded
  EMA (its checkpoint state would need per-rank saving); instead `ema.update_interval` lets FSDP runs
  update every N steps with smoothing**N, which keeps the same half-life and pays the gather 1/N as often.

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
from composer.algorithms.ema.ema import EMAParameters, get_model_context_manager
from composer.core import Event, State
from composer.loggers import Logger

# Name segments distributed wrappers add to parameter names (DDP, FSDP, torch.compile).
_WRAPPER_SEGMENTS = ("module.", "_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
UNET_PREFIX = "unet."


def lerp_ema(model: torch.nn.Module, ema: EMAParameters, smoothing: float) -> None:
    """ema = smoothing * ema + (1 - smoothing) * model, as one fused in-place foreach lerp.

    Same average as Composer's `compute_ema`, which runs `ema.copy_(ema * s + p * (1 - s))` tensor by
    tensor with two temporaries each: at SD2-base shapes on CPU that took 7.3 s per update against 0.5 s
    here (`make bench` measured both), and on GPU it moves ~3x the bytes.
    """
    with get_model_context_manager(model), torch.no_grad():
        averages, current = [], []
        for source, table in (
            (model.named_parameters(), ema.named_parameters_dict),
            (model.named_buffers(), ema.named_buffers_dict),
        ):
            for name, tensor in source:
                if name in table and tensor.is_floating_point():
                    averages.append(table[name])
                    current.append(tensor.detach())
        if averages:
            torch._foreach_lerp_(averages, current, 1.0 - smoothing)


class HandoffEMA(EMA):
    """Composer EMA with a fused update that, after a weights-only load, starts from the loaded weights."""

    def __init__(self, *, seed_from_loaded_weights: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.seed_from_loaded_weights = seed_from_loaded_weights

    def _pending_seed(self, state: State) -> bool:
        return self.seed_from_loaded_weights and not self.ema_started and int(state.timestamp.batch) == 0

    def match(self, event: Event, state: State) -> bool:
        if event == Event.FIT_START and self._pending_seed(state):
            return True
        return super().match(event, state)

    def apply(self, event: Event, state: State, logger: Logger) -> Any:
        # FIT_START comes after DDP/FSDP wrapping, so the average's parameter names match the updates'.
        if event == Event.FIT_START and self._pending_seed(state):
            self.ema_model = EMAParameters(state.model)
            self.ema_started = True
        if event in (Event.BATCH_END, Event.EPOCH_END):  # the only thing Composer does on these events
            assert self.ema_model is not None and isinstance(self.smoothing, float)
            lerp_ema(state.model, self.ema_model, self.smoothing)
            return None
        return super().apply(event, state, logger)


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


def clean_name(name: str) -> str:
    """`module.unet._fsdp_wrapped_module.conv_in.weight` -> `unet.conv_in.weight`."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


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
    stored = {**ema["ema_model"]["named_parameters_dict"], **ema["ema_model"]["named_buffers_dict"]}
    model_has_ema = bool(ema.get("ema_weights_active", False))
    want_model = model_has_ema == (which == "ema")
    if want_model:
        return _unet_only(model), which
    merged = _unet_only(model)
    merged.update(_unet_only(stored))  # frozen params are not averaged: those come from the model
    return merged, which
