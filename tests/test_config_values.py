"""Every number and choice of every job config is checked when the config loads (shared/config/values.py).

The walk below visits each numeric, enum and checked-string field of the encode, train, bench and estimate
configs, gives it one value its declaration refuses on the command line, and expects the one-line error that
names the key, the value and the allowed range, blamed on the command line. A field added without a
declaration is walked too: numbers then get the default check (finite, >= 0).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

import pytest

from encode.config import EncodeConfig
from shared.config import ConfigError, build_dataclass, load_config
from shared.config.values import Allowed, allowed, check_value, declared, out_of_range_example
from shared.estimate.config import EstimateConfig
from train.bench.config import BenchConfig
from train.config import TrainConfig

# (config class, jobs/<kind>/<name>.yaml the overrides go on top of)
JOBS = {
    "encode": (EncodeConfig, "datasets", "sample"),
    "train": (TrainConfig, "train", "tiny"),
    "bench": (BenchConfig, "bench", "quick"),
    "estimate": (EstimateConfig, "estimate", "sd2-base"),
}
# A valid item of a list-of-sections field whose default list is empty, to put the bad value into.
LIST_ITEM_BASE = {"data.streams": {"uri": "/data/a"}}


@dataclasses.dataclass(frozen=True)
class Case:
    key: str  # dotted key as the error names it
    override: str  # key=value given on the command line
    expect: str  # in the error


def _options(tp: Any) -> list[Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _leaf(tp: Any) -> tuple[str, Any]:
    """("scalar" | "list" | "tuple" | "dict", leaf type) of a field's type."""
    tp = _options(tp)[0]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return "list", args[0]
    if origin is tuple:
        return "tuple", args[0]
    if origin is dict:
        return "dict", args[1]
    return "scalar", tp


def _text(value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return repr(value)


def cases(cls: type, prefix: str = "") -> Iterator[Case]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], prefix + f.name
        kind, leaf = _leaf(tp)
        rule = declared(f)
        if dataclasses.is_dataclass(leaf):
            if kind == "scalar":
                yield from cases(leaf, key + ".")
            elif kind == "list":
                yield from _list_item_cases(f, leaf, key)
        elif typing.get_origin(leaf) is Literal:
            yield Case(key, f"{key}=not-a-choice", f"{key} must be one of")
        elif rule is not None and rule.check is not None:
            yield Case(key, f"{key}=not-valid", f"{key} must be")
        elif leaf in (int, float):
            bad = out_of_range_example(rule)
            assert bad is not None, f"{key}: its declaration accepts every number; give it bounds"
            if leaf is int:
                bad = int(bad)
            yield _numeric_case(key, kind, bad, rule or Allowed(ge=0))


def _numeric_case(key: str, kind: str, bad: Any, rule: Allowed) -> Case:
    text = _text(bad)
    if kind == "scalar":
        return Case(key, f"{key}={text}", f"{key} must be {rule.describe()}, got {text}")
    if kind == "dict":
        return Case(key, f"{key}.256={text}", f"{key}.256 must be {rule.describe()}, got {text}")
    return Case(key, f"{key}=[{text}, {text}]", f"{key}[0] must be {rule.describe()}, got {text}")


def _list_item_cases(f: dataclasses.Field[Any], item_cls: type, key: str) -> Iterator[Case]:
    """Each numeric field of a list-of-sections item (data.streams, schedule), inside a one-item list."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else []  # type: ignore[misc]
    base = dataclasses.asdict(default[0]) if default else dict(LIST_ITEM_BASE[key])
    for case in cases(item_cls):
        if "." in case.key or "[" in case.key or "=" not in case.override:
            continue
        name, value = case.override.split("=", 1)
        if name != case.key:  # dict-valued item fields: none so far
            continue
        flow = ", ".join(f"{k}: {_flow(v)}" for k, v in {**base, name: value}.items())
        yield Case(f"{key}[0].{name}", f"{key}=[{{{flow}}}]", f"{key}[0].{case.expect}")


def _flow(value: Any) -> str:
    return "null" if value is None else str(value)


ALL_CASES = [(job, case) for job, (cls, _, _) in JOBS.items() for case in cases(cls)]


@pytest.mark.parametrize(("job", "case"), ALL_CASES, ids=[f"{j}:{c.key}" for j, c in ALL_CASES])
def test_every_out_of_range_value_is_refused_on_load_naming_key_value_and_range(job: str, case: Case) -> None:
    cls, kind, name = JOBS[job]
    with pytest.raises(ConfigError) as err:
        load_config(cls, name, [case.override], kind=kind)
    message = str(err.value)
    assert message.startswith(f"command line: {case.key}"), message
    assert case.expect in message, message
    assert "\n" not in message, message


def test_the_walk_covers_the_fields_the_issue_names() -> None:
    keys = {c.key for _, c in ALL_CASES}
    for key in (
        "optimizer.lr", "optimizer.betas", "optimizer.eps", "optimizer.weight_decay", "optimizer.warmup",
        "ema.smoothing", "optimizer.grad_clip_norm", "global_batch_size", "device_microbatch_size",
        "save_interval", "data.resolution", "model.caption_dropout", "data.streams[0].proportion",
        "resilience.hang_timeout_s", "data.num_workers", "transform.resolutions", "encoder.batch_size",
        "workers", "step.batch_size", "loader.num_workers", "scaling.efficiency", "schedule[0].samples",
    ):  # fmt: skip
        assert key in keys, f"{key} is not walked"
    assert len(ALL_CASES) >= 140  # 147 when written


@pytest.mark.parametrize("job", JOBS)
def test_every_default_and_shipped_value_is_inside_its_range(job: str) -> None:
    def walk(obj: Any, prefix: str) -> None:  # a loaded config, or a class (its declared defaults)
        hints = typing.get_type_hints(obj if isinstance(obj, type) else type(obj))
        for f in dataclasses.fields(obj):
            if isinstance(obj, type):
                has_factory = f.default_factory is not dataclasses.MISSING
                value = f.default_factory() if has_factory else f.default  # type: ignore[misc]
            else:
                value = getattr(obj, f.name)
            kind, leaf = _leaf(hints[f.name])
            if dataclasses.is_dataclass(leaf) and kind == "scalar":
                walk(value if not isinstance(obj, type) else leaf, f"{prefix}{f.name}.")
            elif dataclasses.is_dataclass(leaf):
                walk(leaf, f"{prefix}{f.name}[*].")
            elif value is not dataclasses.MISSING:
                check_value(f, value, prefix + f.name)

    cls, kind, name = JOBS[job]
    walk(load_config(cls, name, kind=kind), "")
    walk(cls, "")


@dataclasses.dataclass
class _Undeclared:
    workers: int = 2  # no declaration: a count, so >= 0
    rate: float = 0.5
    offset: float = allowed(0.0, finite=True, ge=None)  # declared: any finite number


def test_a_field_without_a_declaration_gets_the_default_check() -> None:
    with pytest.raises(ConfigError, match=r"^<mapping>: workers must be >= 0, got -3$"):
        build_dataclass(_Undeclared, {"workers": -3})
    with pytest.raises(ConfigError, match=r"rate must be >= 0, got inf"):
        build_dataclass(_Undeclared, {"rate": "inf"})
    assert build_dataclass(_Undeclared, {"offset": -2.5}).offset == -2.5


def test_a_bad_value_in_a_yaml_file_names_the_file(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("save_folder: /x\noptimizer:\n  lr: -1\n")
    with pytest.raises(ConfigError, match=rf"^{bad}: optimizer.lr must be > 0, got -1.0$"):
        load_config(TrainConfig, bad)
    with pytest.raises(ConfigError, match=r"^command line: optimizer.lr must be > 0, got -1.0$"):
        load_config(TrainConfig, "tiny", ["optimizer.lr=-1"], kind="train")
