"""The EMA store is keyed by wrapper-independent names and never skips a name silently (issue 15)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from train.ema.algorithm import NamedEMAStore, build_ema, lerp_ema
from train.ema.names import EMAStoreMismatchError, clean_name


class Net(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.unet = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.frozen = nn.Linear(2, 2).requires_grad_(False)
        if extra:
            self.head = nn.Linear(4, 1)


class DDPLike(nn.Module):
    """Names like DDP's (`module.` + the model's names), without a process group."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def filled(model: nn.Module, value: float) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def test_clean_name_drops_whole_wrapper_segments_only() -> None:
    assert clean_name("module.unet._fsdp_wrapped_module.conv_in.weight") == "unet.conv_in.weight"
    assert clean_name("_orig_mod.unet._checkpoint_wrapped_module.x") == "unet.x"
    assert clean_name("unet.submodule.weight") == "unet.submodule.weight"


def test_store_is_keyed_by_clean_names_and_covers_trainable_parameters_only() -> None:
    store = NamedEMAStore(DDPLike(Net()))
    assert set(store.named_parameters_dict) == {
        "unet.0.weight",
        "unet.0.bias",
        "unet.1.weight",
        "unet.1.bias",
    }
    assert "unet.1.running_mean" in store.named_buffers_dict


def test_store_written_under_ddp_swaps_and_updates_an_unwrapped_model() -> None:
    store = NamedEMAStore(filled(DDPLike(Net()), 1.0))
    model = filled(Net(), 3.0)
    lerp_ema(model, store, smoothing=0.5)
    assert all(torch.all(t == 2.0) for t in store.named_parameters_dict.values())
    store.swap_params(model)
    assert torch.all(model.unet[0].weight == 2.0)
    assert all(torch.all(t == 3.0) for t in store.named_parameters_dict.values())


def test_a_parameter_missing_on_either_side_stops_the_job_naming_it() -> None:
    store = NamedEMAStore(Net())
    with pytest.raises(
        EMAStoreMismatchError, match=r"missing from the EMA store: \[head\.bias, head\.weight\]"
    ):
        lerp_ema(Net(extra=True), store, 0.9)
    bigger = NamedEMAStore(Net(extra=True))
    for action in (bigger.swap_params, bigger.transfer_ema_params, bigger.move_params_to_device):
        with pytest.raises(
            EMAStoreMismatchError, match=r"missing from the model: \[head\.bias, head\.weight\]"
        ):
            action(Net())


def prefixed_state(model: nn.Module) -> dict:
    """EMA algorithm state as Composer wrote it from a DDP run: keys with `module.`."""
    ema = build_ema(0.9, "0ba", "1ba", handoff=False)
    store = NamedEMAStore(model)
    return {
        "ema_model": {
            "named_parameters_dict": {f"module.{k}": v for k, v in store.named_parameters_dict.items()},
            "named_buffers_dict": {f"module.{k}": v for k, v in store.named_buffers_dict.items()},
        },
        "ema_weights_active": True,
        "ema_started": True,
        "repr": repr(ema),
    }


def test_loading_a_checkpoint_with_prefixed_ema_keys_rekeys_them() -> None:
    ema = build_ema(0.9, "0ba", "1ba", handoff=False)
    ema.load_state_dict(prefixed_state(filled(Net(), 5.0)))
    assert isinstance(ema.ema_model, NamedEMAStore)
    model = filled(Net(), 1.0)
    ema.ema_model.swap_params(model)  # what BATCH_START does after the resume
    assert torch.all(model.unet[0].weight == 5.0)
    saved = ema.state_dict()
    assert all(not k.startswith("module.") for k in saved["ema_model"]["named_parameters_dict"])


def test_names_that_collide_once_cleaned_are_refused() -> None:
    state = prefixed_state(Net())
    table = state["ema_model"]["named_parameters_dict"]
    table["unet.0.weight"] = table["module.unet.0.weight"]
    with pytest.raises(EMAStoreMismatchError, match=r"same name 'unet\.0\.weight'.*load_weights_only=true"):
        build_ema(0.9, "0ba", "1ba", handoff=False).load_state_dict(state)
