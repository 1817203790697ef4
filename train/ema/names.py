"""Wrapper-independent parameter names for everything keyed by name (the EMA store), and strict pairing.

DDP names a parameter `module.unet.conv_in.weight`, FSDP `unet._fsdp_wrapped_module.conv_in.weight`,
torch.compile `_orig_mod.unet...`, one unwrapped rank `unet.conv_in.weight`. A checkpoint written under one
wrapper is resumed under another whenever the rank count or the FSDP / compile switches change, so names
are stored cleaned and matched cleaned. A name present on one side only is an error, never a skip: a
skipped swap leaves the EMA weights in the model and the run silently trains on from the average.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

# Name segments that wrappers insert (DDP, FSDP, torch.compile, activation checkpointing).
WRAPPER_SEGMENTS = frozenset({"module", "_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module"})
SHOWN_NAMES = 5  # how many missing names an error lists


class EMAStoreMismatchError(RuntimeError):
    """The EMA store and the model do not hold the same parameters; the message names the first ones."""


def clean_name(name: str) -> str:
    """`module.unet._fsdp_wrapped_module.conv_in.weight` -> `unet.conv_in.weight` (whole segments only, so
    a name like `submodule.weight` is left alone)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def clean_keys(table: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """A name -> tensor table re-keyed by `clean_name`; two names that clean to one are refused."""
    cleaned: dict[str, torch.Tensor] = {}
    for name, tensor in table.items():
        key = clean_name(name)
        if key in cleaned:
            raise EMAStoreMismatchError(
                f"{what}: two entries clean to the same name {key!r}; the checkpoint mixes wrapped and "
                "unwrapped names and cannot be resumed; start from its weights with load_weights_only=true"
            )
        cleaned[key] = tensor
    return cleaned


def _first(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else ""
    return ", ".join(names[:SHOWN_NAMES]) + more


def paired(
    live: Iterable[tuple[str, torch.Tensor]], store: Mapping[str, torch.Tensor], what: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model tensor, stored tensor) for every name, matched by clean name; any name on one side only
    stops the job with the first missing names of each side."""
    model = clean_keys(dict(live), f"model {what}")
    only_model = model.keys() - store.keys()
    only_store = store.keys() - model.keys()
    if only_model or only_store:
        raise EMAStoreMismatchError(
            f"the EMA store and the model disagree on their {what}: missing from the EMA store: "
            f"[{_first(only_model)}]; missing from the model: [{_first(only_store)}]. The checkpoint's EMA "
            "was written for another model (model.preset / unet config); resume with the same model, or "
            "start from its weights with load_weights_only=true"
        )
    return [(tensor, store[name]) for name, tensor in model.items()]


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters the average covers (frozen ones are never averaged), under the model's own names."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]
