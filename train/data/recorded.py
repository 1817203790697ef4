"""A resumed run streams the dataset versions it trained on, not whatever version is current now.

A re-encode published while a run is stopped (a Slurm requeue, a supervisor restart, a rerun by hand) made
every restart pin the new current version, which the checkpoint's record then refused: the run could not
resume without a person (docs/reliability.md promises a re-encode changes nothing for a training job). The
versions come from the run's own `train_config.yaml` (train/loop/trainer.py writes the resolved config,
every version pinned, at each start; an s3:// save folder holds its mirror), read before any data is.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import yaml

from shared import storage
from train.config import DataConfig, TrainConfig

log = logging.getLogger(__name__)

CONFIG_FILENAME = "train_config.yaml"  # the resolved config of the run's latest start


def read_recorded_data(places: list[str]) -> dict[str, Any] | None:
    """The `data` section of the first `train_config.yaml` found in `places` (folders), or None."""
    for folder in places:
        try:
            recorded = yaml.safe_load(storage.read_bytes(storage.join(folder, CONFIG_FILENAME)))
        except (FileNotFoundError, yaml.YAMLError):
            continue
        if isinstance(recorded, dict) and isinstance(recorded.get("data"), dict):
            return recorded["data"]
    return None


def pin_recorded_versions(cfg: TrainConfig, places: list[str]) -> TrainConfig:
    """`cfg` with each unpinned dataset (data.uri, or a stream of data.streams) pinned to the version the
    run recorded for that same uri; `data.allow_dataset_change=true` keeps the current versions."""
    if cfg.data.allow_dataset_change:
        return cfg
    recorded = read_recorded_data(places)
    if recorded is None:
        return cfg
    if not cfg.data.is_mix():
        version = _recorded_version(recorded, cfg.data.uri)
        if cfg.data.version is not None or version is None:
            return cfg
        _say(cfg.data.uri, version)
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, version=version))
    streams = []
    for stream in cfg.data.streams:
        matches = [
            s
            for s in recorded.get("streams") or []
            if isinstance(s, dict) and _same(s.get("uri"), stream.uri)
        ]
        version = matches[0].get("version") if len(matches) == 1 else None
        if stream.version is None and isinstance(version, str):
            _say(stream.uri, version)
            stream = dataclasses.replace(stream, version=version)
        streams.append(stream)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, streams=streams))


def _recorded_version(recorded: dict[str, Any], uri: str) -> str | None:
    version = recorded.get("version")
    return version if _same(recorded.get("uri"), uri) and isinstance(version, str) else None


def _same(a: object, b: str) -> bool:
    return isinstance(a, str) and a.rstrip("/") == b.rstrip("/")


def _say(uri: str, version: str) -> None:
    log.info(
        "resuming: %s at version %s, the one this run trained on (its %s)", uri, version, CONFIG_FILENAME
    )


def recorded_version_gone(data: DataConfig, err: Exception) -> str:
    """The message when a version the run recorded no longer exists (`encode gc` while it was stopped)."""
    return (
        f"the dataset version this run trained on is gone from {data.uri or 'a stream'} ({err}): deleted "
        "(e.g. by `encode gc`) while the run was stopped; pass data.allow_dataset_change=true to continue "
        "on the current version"
    )
