"""The allowed values of config fields, declared where each field is declared and checked on load.

A field declares what it accepts in its `dataclasses.field` metadata, most simply through `allowed`:

    lr: float = allowed(1.0e-4, gt=0)                              # > 0
    betas: tuple[float, float] = allowed((0.9, 0.999), ge=0, lt=1)  # each item in [0, 1)
    keep: int = allowed(-1, ge=1, special={-1: "all"})             # >= 1, or -1 (all)
    warmup: str = allowed("10000ba", check=time_string_check)      # a callable for strings

`shared.config.build_dataclass` checks every value a YAML file or the command line gives, before the
dataclass (and its cross-field `__post_init__`) is built, and reports a bad one as it reports an unknown key:
`command line: optimizer.lr must be > 0, got -1.0`. A range applies to every number in the value: each item
of a list or tuple, each value of a mapping. A number field that declares nothing gets `DEFAULT`: finite and
>= 0 (counts, sizes, seconds, rates are never negative); declare `allowed(..., ge=None)`-style bounds (e.g.
`Allowed(finite=True)` for any finite number) where negatives make sense. Literal fields are checked by their
type (`must be one of [...]`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

METADATA_KEY = "allowed"

# (value, key) -> the value to keep (e.g. normalised), or raise ConfigError naming `key`.
Check = Callable[[Any, str], Any]


class ValueRangeError(ValueError):
    """A value outside its field's range; shared.config makes it a ConfigError naming where it came from."""


@dataclasses.dataclass(frozen=True)
class Allowed:
    """The values a field accepts. Bounds apply to each number the value holds."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    # Values accepted outside the bounds, with what they mean (shown in the message), e.g. {-1: "all"}.
    special: Mapping[Any, str] = dataclasses.field(default_factory=dict)
    finite: bool = True  # refuse nan and inf
    # For values bounds cannot describe (time strings, durations): returns the value to keep or raises.
    check: Check | None = None

    def describe(self) -> str:
        """`> 0`, `in [0, 1)`, `>= 1, or -1 (all)`."""
        low = (f"[{_num(self.ge)}", self.ge) if self.ge is not None else (f"({_num(self.gt)}", self.gt)
        high = (f"{_num(self.le)}]", self.le) if self.le is not None else (f"{_num(self.lt)})", self.lt)
        if low[1] is not None and high[1] is not None:
            text = f"in {low[0]}, {high[0]}"
        elif low[1] is not None:
            text = f">= {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}"
        elif high[1] is not None:
            text = f"<= {_num(self.le)}" if self.le is not None else f"< {_num(self.lt)}"
        else:
            text = "a finite number" if self.finite else "a number"
        specials = ", ".join(f"{_num(v)} ({meaning})" for v, meaning in self.special.items())
        return f"{text}, or {specials}" if specials else text

    def accepts(self, number: float) -> bool:
        if number in self.special:
            return True
        if self.finite and not math.isfinite(number):
            return False
        return not (
            (self.ge is not None and not number >= self.ge)
            or (self.gt is not None and not number > self.gt)
            or (self.le is not None and not number <= self.le)
            or (self.lt is not None and not number < self.lt)
        )


# What a number field that declares nothing accepts: counts, sizes, seconds and rates are never negative.
DEFAULT = Allowed(ge=0)


def allowed(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    **limits: Any,
) -> Any:
    """`dataclasses.field` with the field's allowed values in its metadata (the keywords of `Allowed`)."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={METADATA_KEY: Allowed(**limits)}
    )


def declared(f: dataclasses.Field[Any]) -> Allowed | None:
    """The field's own declaration, or None (then numbers get DEFAULT)."""
    return f.metadata.get(METADATA_KEY)


def check_value(f: dataclasses.Field[Any], value: Any, key: str) -> Any:
    """`value` (coerced to the field's type) if the field allows it, else ValueRangeError naming `key`,
    the value and the allowed range. Returns what a `check` callable returned (e.g. a normalised string)."""
    rule = declared(f)
    if rule is not None and rule.check is not None and value is not None:
        return rule.check(value, key)
    _check_numbers(rule or DEFAULT, value, key)
    return value


def _check_numbers(rule: Allowed, value: Any, key: str) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        if not rule.accepts(value):
            raise ValueRangeError(f"{key} must be {rule.describe()}, got {value!r}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_numbers(rule, item, f"{key}[{i}]")
    elif isinstance(value, Mapping):
        for name, item in value.items():
            _check_numbers(rule, item, f"{key}.{name}")


def out_of_range_example(rule: Allowed | None) -> float | None:
    """A number the rule refuses (for tests and docs), or None when it accepts every finite number."""
    rule = rule or DEFAULT
    for candidate in (
        _below(rule.ge, rule.gt),
        _above(rule.le, rule.lt),
        math.nan if rule.finite else None,
    ):
        if candidate is not None and not rule.accepts(candidate):
            return candidate
    return None


def _below(ge: float | None, gt: float | None) -> float | None:
    if ge is not None:
        return ge - 1 if float(ge).is_integer() else ge - abs(ge) - 1
    return gt


def _above(le: float | None, lt: float | None) -> float | None:
    if le is not None:
        return le + 1
    return lt


def _num(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
