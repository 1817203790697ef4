"""The run record kept in every checkpoint: what the run trained on and with; resuming on other data is
refused."""

from __future__ import annotations

import logging
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger

log = logging.getLogger(__name__)


class DatasetChangedError(RuntimeError):
    """A resume would continue on other data than the checkpoint was trained on."""


class ObjectiveChangedError(RuntimeError):
    """A resume would continue towards another target than the checkpoint's optimizer and EMA state."""


# What the U-Net learns to output for which input: a resume that changes one trains a different model on
# the old one's optimizer moments and EMA, and export (which reads the record) would describe the new one.
OBJECTIVE_KEYS = (
    "prediction_type",
    "num_train_timesteps",
    "beta_start",
    "beta_end",
    "beta_schedule",
    "zero_terminal_snr",
)


def check_objective_unchanged(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume with another prediction type or noise schedule than the checkpoint's. A new phase
    with another objective (SD2's epsilon -> v handoff) starts from the weights in a new save folder."""
    before, now = saved.get("model"), current.get("model", {})
    if not isinstance(before, dict):
        return  # a record without the model section: nothing to compare
    changed = [key for key in OBJECTIVE_KEYS if key in before and before[key] != now.get(key)]
    if not changed:
        return
    was = ", ".join(f"{key}={before[key]}" for key in changed)
    new = ", ".join(f"{key}={now.get(key)}" for key in changed)
    raise ObjectiveChangedError(
        f"refusing to resume: the checkpoint trained with {was} but this run asks for {new}. Set "
        f"{' / '.join(f'model.{key}' for key in changed)} back to the checkpoint's (its train_config.yaml "
        "records them), or start a new phase from its weights: save_folder=<a new folder> "
        "load_path=<this checkpoint> load_weights_only=true"
    )


# ------------------------------------------------------------------------------------------ run record
def check_dataset_unchanged(saved: dict[str, Any], current: dict[str, Any], allow: bool) -> bool:
    """Refuse to resume on other data than the checkpoint's, unless `allow` (data.allow_dataset_change).
    Returns whether the data changed (and was allowed to)."""
    before, now = saved.get("dataset", {}), current.get("dataset", {})
    # epoch_size: absent from checkpoints written before it was recorded, which used none (the default)
    changed = [k for k in ("fingerprint", "resolution", "epoch_size") if before.get(k) != now.get(k)]
    if not changed:
        return False
    if "mix" in before or "mix" in now:
        return _check_mix_unchanged(before, now, allow)
    what = (
        f"the checkpoint was trained on {before.get('uri')} version {before.get('version')} at "
        f"{before.get('resolution')} px (fingerprint {before.get('fingerprint')}, epoch_size "
        f"{before.get('epoch_size')}) but this run reads {now.get('uri')} version {now.get('version')} at "
        f"{now.get('resolution')} px (fingerprint {now.get('fingerprint')}, epoch_size "
        f"{now.get('epoch_size')})"
    )
    if allow:
        log.warning("data.allow_dataset_change=true: resuming although %s", what)
        return True
    raise DatasetChangedError(
        f"refusing to resume: {what}. Pass data.version={before.get('version')} (and the original data.uri / "
        "data.resolution / data.epoch_size) to continue on the same data, or data.allow_dataset_change=true "
        "to switch datasets."
    )


def _describe_mix(dataset: dict[str, Any]) -> str:
    """`name=uri@version (weight)` per stream, the batching method and epoch size; or the one dataset."""
    mix = dataset.get("mix")
    if mix is None:
        return f"the one dataset {dataset.get('uri')} version {dataset.get('version')}"
    parts = [
        f"{s['name']}={s['uri']}@{s['version']}"
        + (f" ({s['weight'][0]} {s['weight'][1]})" if s["weight"] else "")
        for s in mix["streams"]
    ]
    return f"the mix [{'; '.join(parts)}] batching {mix['batching_method']}" + (
        f", epoch_size {mix['epoch_size']}" if mix.get("epoch_size") else ""
    )


def _check_mix_unchanged(before: dict[str, Any], now: dict[str, Any], allow: bool) -> bool:
    what = (
        f"the checkpoint was trained on {_describe_mix(before)} at {before.get('resolution')} px "
        f"(fingerprint {before.get('fingerprint')}) but this run reads {_describe_mix(now)} at "
        f"{now.get('resolution')} px (fingerprint {now.get('fingerprint')})"
    )
    if allow:
        log.warning("data.allow_dataset_change=true: resuming although %s", what)
        return True
    raise DatasetChangedError(
        f"refusing to resume: {what}. Set data.streams (and data.batching_method / data.epoch_size / "
        "data.resolution) back to the checkpoint's, as its train_config.yaml records them, or pass "
        "data.allow_dataset_change=true to continue on the new mix."
    )


class RunRecord(Callback):
    """What the run trained on and with, saved in every checkpoint (`state["callbacks"]["RunRecord"]`).

    Holds the dataset identity (uri, version, resolution, fingerprint), the model recipe (preset, U-Net
    config, prediction type, noise schedule) and the encoders the latents were made with (the manifest's
    `config.encoder` and `fingerprints.encoders`), so export rebuilds the same VAE and text encoder.
    Loading a checkpoint (autoresume / load_path without weights-only) checks the objective and the dataset
    are unchanged.
    """

    def __init__(self, record: dict[str, Any], allow_dataset_change: bool = False):
        self.record = record
        self.allow_dataset_change = allow_dataset_change
        self.data_changed = False

    def state_dict(self) -> dict[str, Any]:
        return dict(self.record)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_objective_unchanged(state, self.record)
        self.data_changed = check_dataset_unchanged(state, self.record, self.allow_dataset_change)

    def fit_start(self, state: State, logger: Logger) -> None:
        if not self.data_changed:
            return
        # Streaming's resume state is (epoch, samples into the epoch), applied to whatever data is read now.
        log.warning(
            "data position remapped onto the new data: the checkpoint stopped %d samples into epoch %d; "
            "the new data continues at that same sample count into epoch %d of its own order (the samples "
            "before it in the new order are not seen this epoch)",
            int(state.timestamp.sample_in_epoch), int(state.timestamp.epoch), int(state.timestamp.epoch),
        )  # fmt: skip
