"""Value checks and shared types of the train config: Composer time strings, wall-clock durations,
literals."""

from __future__ import annotations

import re
from typing import Literal

from shared.config import ConfigError
from shared.config.values import Check

# Composer time strings this job accepts: an integer count of a unit, or a fraction of the whole run.
_TIME_STRING = re.compile(r"^(\d+(ep|ba|sp|tok)|\d*\.?\d+dur)$")
_INTERVAL_UNITS = ("ba", "ep")

Precision = Literal["auto", "fp32", "amp_bf16", "amp_fp16"]
Device = Literal["auto", "cpu", "gpu"]
PredictionType = Literal["epsilon", "v_prediction"]
SamplerKind = Literal["ddim", "euler"]

SD2_PROMPTS = [
    "a photograph of an astronaut riding a horse",
    "a red sports car parked on a city street at night",
    "a bowl of fresh fruit on a wooden table, studio lighting",
    "a watercolor painting of a lighthouse on a cliff",
]


def check_time_string(value: str, key: str, units: tuple[str, ...] | None = None) -> str:
    """Reject anything Composer would not parse, naming the key and an example."""
    text = str(value).strip()
    if not _TIME_STRING.match(text):
        raise ConfigError(
            f"{key} must be a Composer time string (e.g. 20ba, 1ep, 10000sp or 0.5dur), got {value!r}"
        )
    if units and not any(text.endswith(u) for u in units):
        raise ConfigError(
            f"{key} must be in one of the units {list(units)} (e.g. 100{units[0]}), got {value!r}"
        )
    return text


def time_string(*units: str, at_least: int = 0) -> Check:
    """A field's `allowed(check=...)`: a Composer time string, in `units` when given, counting >= at_least."""

    def check(value: str, key: str) -> str:
        text = check_time_string(value, key, units or None)
        if at_least and time_count(text) < at_least:
            raise ConfigError(f"{key} must be at least {at_least}{units[0]}, got {value!r}")
        return text

    return check


def wall_time(value: str, key: str) -> str:
    """A field's `allowed(check=...)`: a wall-clock duration such as 90m (see wall_time_seconds)."""
    wall_time_seconds(value, key)
    return str(value).strip()


def time_count(value: str) -> int:
    """The integer count of a time string such as `100ba` (not for `dur`)."""
    return int(re.match(r"^\d+", value).group(0))  # type: ignore[union-attr]


BatchingMethod = Literal["random", "stratified", "per_stream", "device_per_stream"]


_WALL_TIME = re.compile(r"^(\d+(\.\d+)?)(s|m|h|d)$")
_WALL_TIME_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def wall_time_seconds(value: str, key: str) -> float:
    """`90m`, `11.5h`, `2d` -> seconds."""
    match = _WALL_TIME.match(str(value).strip())
    if not match:
        raise ConfigError(f"{key} must be a duration such as 3600s, 90m, 11.5h or 2d, got {value!r}")
    return float(match.group(1)) * _WALL_TIME_UNITS[match.group(3)]
