"""Typed job configs: YAML from `jobs/` plus dotted `key=value` overrides -> a dataclass.

Every job has one nested config dataclass. `load_config` builds it from a YAML file (or a name that resolves
to one in `jobs/`), applies overrides such as `output.uri=s3://bucket/x` or `resolutions=[256,512]`, coerces
values to the declared field types and rejects any key the dataclass does not declare, naming the key, the
closest declared one ("did you mean optimizer.lr?") and the keys that exist. Every value given is checked
against its field's allowed values (config/values.py: ranges declared in the field's metadata; numbers that
declare none must be finite and >= 0), before any cross-field rule. Errors name where the bad key or value
came from: the YAML file, or `command line` for an override. Cross-field rules live in each dataclass's
`__post_init__`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from shared.config.values import ValueRangeError, check_value

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]
JOBS_DIR = REPO_ROOT / "jobs"


class ConfigError(ValueError):
    """A config file or override that does not fit the job's config dataclass."""


def resolve_job_file(name_or_path: str | Path, kind: str) -> Path:
    """Turn `laion400m` into `jobs/<kind>/laion400m.yaml`; pass real paths through."""
    candidate = Path(name_or_path)
    known = ", ".join(sorted(p.stem for p in (JOBS_DIR / kind).glob("*.yaml")))
    if not candidate.is_absolute() and not candidate.exists() and (REPO_ROOT / candidate).is_file():
        candidate = REPO_ROOT / candidate  # a launcher names repo files from the repo root (any cwd, any pod)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists():
        if not candidate.exists():
            raise ConfigError(
                f"config file {candidate} does not exist; or use a name in jobs/{kind}/: {known}"
            )
        return candidate
    named = JOBS_DIR / kind / f"{name_or_path}.yaml"
    if named.exists():
        return named
    raise ConfigError(f"no config named {name_or_path!r} in {JOBS_DIR / kind}; known: {known}")


def load_config(
    cls: type[T],
    source: str | Path | Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    kind: str | None = None,
) -> T:
    """Build `cls` from a YAML file / job name / mapping, then apply `key=value` overrides."""
    where = "<defaults>"
    raw: dict[str, Any] = {}
    if isinstance(source, Mapping):
        raw, where = dict(source), "<mapping>"
    elif source is not None:
        path = resolve_job_file(source, kind) if kind else Path(source)
        where = str(path)
        loaded = _read_yaml(path)
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping at the top level, not {type(loaded).__name__}")
        raw = loaded
    for item in overrides:
        check_override_key(cls, item)
        _apply_override(raw, item)
    try:
        return build_dataclass(cls, raw, where=where)
    except ConfigError as err:
        raise _blame_command_line(err, where, [item.split("=", 1)[0].strip() for item in overrides]) from err


def _blame_command_line(err: ConfigError, where: str, overridden: Sequence[str]) -> ConfigError:
    """A bad value the command line gave (`gpus=abc`) is the command line's, not the YAML file's."""
    message = str(err)
    if not message.startswith(f"{where}: "):
        return err
    rest = message[len(where) + 2 :]
    key = rest.split(" ", 1)[0]
    if any(key == k or key.startswith((f"{k}.", f"{k}[")) for k in overridden):
        return ConfigError(f"command line: {rest}")
    return err


def check_override_key(cls: type, item: str) -> None:
    """Refuse a command-line key the config does not declare, blaming the command line (not the YAML file)
    and suggesting the closest key; keys below a mapping-typed field (e.g. `per_gpu.256`) are free."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. {example_override(cls)})")
    parts = item.split("=", 1)[0].strip().split(".")
    node: Any = cls
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return
        fields = {f.name: f for f in dataclasses.fields(node) if f.init}
        if part not in fields:
            prefix = ".".join(parts[:depth])
            message = unknown_key_message(prefix, [part], fields)
            if "did you mean" not in message and (elsewhere := _close_nested_key(cls, part)):
                message = message.replace(
                    f"unknown key {part}", f"unknown key {part} (did you mean {elsewhere}?)"
                )
            raise ConfigError(f"command line: {message}")
        node = _dataclass_in(typing.get_type_hints(node)[part])


def example_override(cls: type) -> str:
    """`seed=17`-style example from the config's own first scalar field with a default."""
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if (
            f.init
            and isinstance(f.default, (int, float, str))
            and not isinstance(f.default, bool)
            and f.default
        ):
            return f"{f.name}={f.default}"
    return "section.key=value"


def _close_nested_key(cls: type, key: str) -> str | None:
    """The dotted key deeper in the config whose last part is closest to `key` (`lr` -> `optimizer.lr`)."""
    paths = list(_dotted_keys(cls, ""))
    close = difflib.get_close_matches(key, [p.rsplit(".", 1)[-1] for p in paths], n=1, cutoff=0.6)
    return next((p for p in paths if p.rsplit(".", 1)[-1] == close[0]), None) if close else None


def _dotted_keys(cls: Any, prefix: str) -> typing.Iterator[str]:
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        yield prefix + f.name
        inner = _dataclass_in(typing.get_type_hints(cls)[f.name])
        if dataclasses.is_dataclass(inner):
            yield from _dotted_keys(inner, f"{prefix}{f.name}.")


def _dataclass_in(tp: Any) -> Any:
    """The dataclass a field holds (also inside `X | None`), else the type itself."""
    for option in typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ():
        if dataclasses.is_dataclass(option):
            return option
    return tp


def unknown_key_message(prefix: str, keys: typing.Sequence[str], known: typing.Iterable[str]) -> str:
    """`unknown key optimizer.lrr (did you mean optimizer.lr?); known keys in optimizer: betas, lr, ...`."""
    known = sorted(known)
    lead = f"{prefix}." if prefix else ""
    named = []
    for key in keys:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        named.append(lead + key + (f" (did you mean {lead}{close[0]}?)" if close else ""))
    section = f"in {prefix}" if prefix else "at the top level"
    plural = "s" if len(keys) > 1 else ""
    return f"unknown key{plural} {', '.join(named)}; known keys {section}: {', '.join(known)}"


def _read_yaml(path: Path) -> Any:
    """A config file's YAML; a file that is not one is a ConfigError naming it (not a parser traceback)."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except IsADirectoryError:
        raise ConfigError(f"{path} is a folder; pass a YAML file (or a job name from jobs/)") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """The parser's problem and where (line, column), in one line."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else str(problem)


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. output.uri=/tmp/out)")
    dotted, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(
            f"override {item!r}: the value is not valid YAML ({_yaml_problem(err)}); quote it, e.g. "
            f"{dotted}='\"...\"', or close its brackets"
        ) from None
    node = raw
    parts = dotted.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def build_dataclass(cls: type[T], raw: Mapping[str, Any], where: str = "<mapping>", prefix: str = "") -> T:
    """Recursively coerce a mapping into dataclass `cls`, rejecting unknown keys."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: {unknown_key_message(prefix.rstrip('.'), unknown, fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in raw.items():
        key = prefix + name
        coerced = _coerce(hints[name], value, where, key)
        try:  # the field's allowed values (shared/config/values.py), before any cross-field rule sees them
            kwargs[name] = check_value(fields[name], coerced, key)
        except (ValueRangeError, ConfigError) as err:
            raise ConfigError(_located(err, where)) from None
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field with no default and no value
        raise ConfigError(f"{where}: {prefix or 'config'}: {err}") from err
    except ConfigError as err:  # a cross-field rule of __post_init__: say where the config came from
        raise ConfigError(_located(err, where)) from None


def _located(err: Exception, where: str) -> str:
    message = str(err)
    return message if message.startswith(f"{where}: ") else f"{where}: {message}"


def _coerce(tp: Any, value: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors: list[tuple[Any, str]] = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(option, value, where, key)
            except ConfigError as err:
                errors.append((option, str(err)))
        # A word where a word or a mapping fits (transform.buckets: none | auto | {...}): name the words.
        words = [e for o, e in errors if typing.get_origin(o) is typing.Literal and isinstance(value, str)]
        raise ConfigError((words or [e for _, e in errors] or [f"{where}: {key}: bad value {value!r}"])[-1])
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {key} must be one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return build_dataclass(tp, value, where, key + ".")
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            value = [value]
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, where, f"{key}[{i}]") for i, v in enumerate(value))
        if origin is tuple and args:
            if len(args) != len(value):
                raise ConfigError(f"{where}: {key} needs {len(args)} items, got {value!r}")
            pairs = enumerate(zip(args, value, strict=True))
            return tuple(_coerce(a, v, where, f"{key}[{i}]") for i, (a, v) in pairs)
        inner = args[0] if args else Any
        items = [_coerce(inner, v, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: {key} must be a mapping, got {value!r}")
        kt, vt = args if len(args) == 2 else (str, Any)
        return {
            _coerce(kt, k, where, f"{key} key"): _coerce(vt, v, where, f"{key}.{k}") for k, v in value.items()
        }
    return _coerce_scalar(tp, value, where, key)


def _coerce_scalar(tp: Any, value: Any, where: str, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # `progress=0` on the command line reads as int
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
    if tp is int:
        return _coerce_int(value, where, key)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}: {key} must be a number, got {value!r}") from err
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: {key} must be a string, got {value!r}")
        return "" if value is None else str(value)
    return value


def _coerce_int(value: Any, where: str, key: str) -> int:
    """Integers, integral floats and strings of either (`1e6`, `"512"`); exact for big ints."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value  # not through float: 2**53 + 1 would silently lose its last bit
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value)  # "512"
    try:
        as_float = float(value)  # 1e6, "1e6", 512.0 (YAML 1.1 reads 1e6 as a string)
        if as_float == int(as_float):
            return int(as_float)
    except (ValueError, OverflowError):  # "abc", inf, nan
        pass
    raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (saved next to every output)."""
    return _plain(dataclasses.asdict(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
