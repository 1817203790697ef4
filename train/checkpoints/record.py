"""The run record kept in every checkpoint: what the run trained on and with; resuming on other data is
refused."""

from __future__ import annotations

import logging
from typing import Any

from composer.core import Callback

log = logging.getLogger(__name__)


class DatasetChangedError(RuntimeError):
    """A resume would continue on other data than the checkpoint was trained on."""


# ------------------------------------------------------------------------------------------ run record
def check_dataset_unchanged(saved: dict[str, Any], current: dict[str, Any], allow: bool) -> None:
    """Refuse to resume on other data than the checkpoint's, unless `allow` (data.allow_dataset_change)."""
    before, now = saved.get("dataset", {}), current.get("dataset", {})
    changed = [k for k in ("fingerprint", "resolution") if before.get(k) != now.get(k)]
    if not changed:
        return
    what = (
        f"the checkpoint was trained on {before.get('uri')} version {before.get('version')} at "
        f"{before.get('resolution')} px (fingerprint {before.get('fingerprint')}) but this run reads "
        f"{now.get('uri')} version {now.get('version')} at {now.get('resolution')} px (fingerprint "
        f"{now.get('fingerprint')})"
    )
    if allow:
        log.warning("data.allow_dataset_change=true: resuming although %s", what)
        return
    raise DatasetChangedError(
        f"refusing to resume: {what}. Pass data.version={before.get('version')} (and the original data.uri / "
        "data.resolution) to continue on the same data, or data.allow_dataset_change=true to switch datasets."
    )


class RunRecord(Callback):
    """What the run trained on and with, saved in every checkpoint (`state["callbacks"]["RunRecord"]`).

    Holds the dataset identity (uri, version, resolution, fingerprint), the model recipe (preset, U-Net
    config, prediction type, noise schedule) and the encoders the latents were made with (the manifest's
    `config.encoder` and `fingerprints.encoders`), so export rebuilds the same VAE and text encoder.
    Loading a checkpoint (autoresume / load_path without weights-only) checks the dataset is unchanged.
    """

    def __init__(self, record: dict[str, Any], allow_dataset_change: bool = False):
        self.record = record
        self.allow_dataset_change = allow_dataset_change

    def state_dict(self) -> dict[str, Any]:
        return dict(self.record)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_dataset_unchanged(state, self.record, self.allow_dataset_change)
