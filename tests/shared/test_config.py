"""shared/config.py: YAML + dotted overrides -> typed dataclasses, and every job YAML in jobs/ parses."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from shared import config as config_module
from shared.config import ConfigError, build_dataclass, config_to_dict, load_config, resolve_job_file

JOBS_DIR = Path(__file__).resolve().parents[2] / "jobs"


@dataclass
class Inner:
    size: int = 256
    ratio: float = 2.0
    names: list[str] = field(default_factory=lambda: ["a"])


@dataclass
class Leaf:
    depth: int = 0


@dataclass
class Middle:
    leaf: Leaf = field(default_factory=Leaf)
    label: str = "m"


@dataclass
class Job:
    name: str = "job"
    enabled: bool = True
    workers: int = 2
    lr: float = 1e-4
    mode: Literal["fast", "slow"] = "fast"
    level: Literal[1, 2, 3] = 1
    resolutions: list[int] = field(default_factory=lambda: [256, 512])
    pair: tuple[int, str] = (1, "x")
    sizes: tuple[int, ...] = (1, 2)
    limit: int | None = None
    threshold: float | None = 0.5
    note: str | None = None
    weights: dict[str, float] = field(default_factory=dict)
    per_resolution: dict[int, int] = field(default_factory=dict)
    anything: Any = None
    inner: Inner = field(default_factory=Inner)
    maybe_inner: Inner | None = None
    middle: Middle = field(default_factory=Middle)

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ConfigError("workers must be >= 0")


@dataclass
class Required:
    uri: str


def write_yaml(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------ load + override
def test_yaml_file_with_nested_sections_and_overrides(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        "name: from-yaml\nworkers: 4\ninner:\n  size: 512\n  names: [x, y]\nmiddle:\n  leaf:\n    depth: 3\n",
    )
    cfg = load_config(Job, path, ["inner.ratio=1.5", "middle.leaf.depth=7", "resolutions=[64,128]"])
    assert cfg.name == "from-yaml" and cfg.workers == 4
    assert cfg.inner == Inner(size=512, ratio=1.5, names=["x", "y"])
    assert cfg.middle.leaf.depth == 7 and cfg.middle.label == "m"
    assert cfg.resolutions == [64, 128]


def test_defaults_mapping_and_empty_file(tmp_path: Path) -> None:
    assert load_config(Job) == Job()
    assert load_config(Job, {"workers": 3}).workers == 3
    assert load_config(Job, write_yaml(tmp_path, "")) == Job()
    assert load_config(Job, write_yaml(tmp_path, "# only a comment\n")) == Job()


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must hold a mapping at the top level, not list"):
        load_config(Job, write_yaml(tmp_path, "- a\n- b\n"))


def test_override_creates_a_section_missing_from_the_yaml(tmp_path: Path) -> None:
    cfg = load_config(Job, write_yaml(tmp_path, "name: x\n"), ["maybe_inner.size=64"])
    assert cfg.maybe_inner == Inner(size=64)


def test_override_value_forms() -> None:
    cfg = load_config(
        Job,
        overrides=[
            "name=with=equals",  # only the first `=` splits
            "note=",  # empty: the empty string
            "limit=null",
            "weights={a: 1, b: 2.5}",
            "anything=[1, two]",
        ],
    )
    assert cfg.name == "with=equals"
    assert cfg.note == "" and cfg.limit is None
    assert cfg.weights == {"a": 1.0, "b": 2.5}
    assert cfg.anything == [1, "two"]


@pytest.mark.parametrize("bad", ["workers", "inner.size", "no-equals-here"])
def test_override_without_equals_is_rejected(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"must look like key=value \(e\.g\. name=job\)"):
        load_config(Job, overrides=[bad])


def test_override_into_a_value_is_rejected() -> None:
    with pytest.raises(ConfigError, match="'name' is a value, not a section"):
        load_config(Job, {"name": "set"}, ["name.sub=1"])
    with pytest.raises(ConfigError, match="name must be a string"):  # not in the YAML: caught by its type
        load_config(Job, overrides=["name.sub=1"])


# ----------------------------------------------------------------------------------- unknown keys
def test_unknown_top_level_key_is_named_with_the_known_ones(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "workrs: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(Job, path)
    message = str(info.value)
    assert str(path) in message and "unknown key workrs (did you mean workers?)" in message
    assert "known keys at the top level:" in message


def test_unknown_nested_key_is_named_with_its_section() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown key middle\.leaf\.deepth \(did you mean middle\.leaf\.depth\?\)"
    ):
        load_config(Job, overrides=["middle.leaf.deepth=1"])
    with pytest.raises(
        ConfigError, match=r"unknown key inner\.sise \(did you mean inner\.size\?\); known keys in inner"
    ):
        load_config(Job, {"inner": {"sise": 1}})


def test_unknown_override_is_blamed_on_the_command_line_not_the_file(tmp_path: Path) -> None:
    """`make train ARGS='lrr=1'` is the user's typo on the command line, not a fault of tiny.yaml."""
    path = write_yaml(tmp_path, "workers: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(Job, path, ["workrs=4"])
    message = str(info.value)
    assert message.startswith("command line: unknown key workrs (did you mean workers?)"), message
    assert str(path) not in message


def test_a_key_with_no_close_match_gets_no_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Job, overrides=["zzzzzz=1"])
    assert "did you mean" not in str(info.value) and "unknown key zzzzzz;" in str(info.value)


def test_section_given_a_scalar_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"inner must be a mapping, got 5"):
        load_config(Job, {"inner": 5})


def test_missing_required_field_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="uri"):
        load_config(Required, {})
    assert load_config(Required, overrides=["uri=s3://b/x"]).uri == "s3://b/x"


def test_post_init_checks_run() -> None:
    with pytest.raises(ConfigError, match="workers must be >= 0"):
        load_config(Job, overrides=["workers=-1"])


# ------------------------------------------------------------------------------------ coercion
@pytest.mark.parametrize(
    ("text", "want"),
    [
        *[("true", True), ("false", False), ("yes", True), ("no", False)],
        *[("True", True), ("1", True), ("0", False)],
    ],
)
def test_bool_strings(text: str, want: bool) -> None:
    assert load_config(Job, overrides=[f"enabled={text}"]).enabled is want
    assert load_config(Job, {"enabled": text}).enabled is want  # a quoted YAML string


@pytest.mark.parametrize("bad", ["maybe", "2", 2, 0.0, None])
def test_bad_bool_is_rejected(bad: Any) -> None:
    with pytest.raises(ConfigError, match="enabled must be true or false"):
        load_config(Job, {"enabled": bad})


BIG = 2**53 + 1  # the first integer a float cannot hold


@pytest.mark.parametrize(
    ("value", "want"),
    [(3, 3), ("3", 3), (3.0, 3), ("1e3", 1000), (1e6, 10**6), (BIG, BIG), (str(BIG), BIG)],
)
def test_int_accepts_integral_values_exactly(value: Any, want: int) -> None:
    got = load_config(Job, {"workers": value}).workers
    assert got == want and type(got) is int


@pytest.mark.parametrize("bad", [2.5, "2.5", "abc", True, [1], "inf", float("nan"), float("inf")])
def test_int_rejects_everything_else(bad: Any) -> None:
    with pytest.raises(ConfigError, match="workers must be an integer"):
        load_config(Job, {"workers": bad})


def test_float_accepts_ints_and_yaml_exponent_strings() -> None:
    # PyYAML (YAML 1.1) reads `1e-4` without a dot as a string; the field type makes it a number.
    assert load_config(Job, overrides=["lr=1e-4"]).lr == pytest.approx(1e-4)
    got = load_config(Job, {"lr": 3}).lr
    assert got == 3.0 and type(got) is float
    for bad in ("fast", True, [1.0]):
        with pytest.raises(ConfigError, match="lr must be a number"):
            load_config(Job, {"lr": bad})


def test_literal_values() -> None:
    assert load_config(Job, overrides=["mode=slow", "level=3"]).mode == "slow"
    with pytest.raises(ConfigError, match=r"mode must be one of \['fast', 'slow'\], got 'medium'"):
        load_config(Job, overrides=["mode=medium"])
    with pytest.raises(ConfigError, match="level must be one of"):
        load_config(Job, overrides=["level=4"])


def test_lists_and_tuples() -> None:
    cfg = load_config(Job, overrides=["resolutions=512", "sizes=[4, '5', 6.0]", "pair=[2, 3]"])
    assert cfg.resolutions == [512]  # a scalar becomes a one-item list
    assert cfg.sizes == (4, 5, 6) and isinstance(cfg.sizes, tuple)
    assert cfg.pair == (2, "3")
    with pytest.raises(ConfigError, match=r"pair needs 2 items, got \[1, 2, 3\]"):
        load_config(Job, overrides=["pair=[1, 2, 3]"])
    with pytest.raises(ConfigError, match=r"resolutions\[1\] must be an integer, got 'big'"):
        load_config(Job, overrides=["resolutions=[256, big]"])


def test_optional_fields() -> None:
    cfg = load_config(Job, overrides=["limit=5", "threshold=null", "note=hello"])
    assert cfg.limit == 5 and cfg.threshold is None and cfg.note == "hello"
    with pytest.raises(ConfigError, match="limit must be an integer"):
        load_config(Job, overrides=["limit=lots"])
    assert load_config(Job, {"maybe_inner": None}).maybe_inner is None
    assert load_config(Job, {"maybe_inner": {"ratio": 1}}).maybe_inner == Inner(ratio=1.0)


def test_dict_keys_and_values_follow_the_declared_types() -> None:
    cfg = load_config(Job, overrides=["per_resolution={256: '8', '512': 4}", "weights={1: 2}"])
    assert cfg.per_resolution == {256: 8, 512: 4}
    assert cfg.weights == {"1": 2.0}
    with pytest.raises(ConfigError, match="per_resolution must be a mapping"):
        load_config(Job, overrides=["per_resolution=[1, 2]"])
    with pytest.raises(ConfigError, match=r"per_resolution\.256 must be an integer"):
        load_config(Job, overrides=["per_resolution={256: many}"])


def test_strings_do_not_swallow_structures() -> None:
    assert load_config(Job, {"name": 123}).name == "123"
    with pytest.raises(ConfigError, match="name must be a string"):
        load_config(Job, {"name": {"a": 1}})


def test_build_dataclass_keeps_a_ready_instance() -> None:
    inner = Inner(size=8)
    assert build_dataclass(Job, {"inner": inner}).inner is inner


# ---------------------------------------------------------------------------------- config_to_dict
def test_config_to_dict_round_trip() -> None:
    cfg = load_config(
        Job,
        overrides=["maybe_inner.size=64", "per_resolution={256: 8}", "pair=[5, z]", "weights={a: 0.5}"],
    )
    plain = config_to_dict(cfg)
    assert plain["pair"] == [5, "z"] and plain["sizes"] == [1, 2]  # tuples become JSON-able lists
    assert plain["inner"] == {"size": 256, "ratio": 2.0, "names": ["a"]}
    assert load_config(Job, plain) == cfg


# -------------------------------------------------------------------------------- resolve_job_file
def test_resolve_job_file_by_name_and_by_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = tmp_path / "jobs"
    (jobs / "datasets").mkdir(parents=True)
    (jobs / "datasets" / "laion.yaml").write_text("name: laion\n")
    (jobs / "datasets" / "sample.yaml").write_text("name: sample\n")
    monkeypatch.setattr(config_module, "JOBS_DIR", jobs)

    assert resolve_job_file("laion", "datasets") == jobs / "datasets" / "laion.yaml"
    own = write_yaml(tmp_path, "name: own\n", "own.yml")
    assert resolve_job_file(str(own), "datasets") == own
    with pytest.raises(ConfigError, match=r"no config named 'laoin' in .*datasets; known: laion, sample"):
        resolve_job_file("laoin", "datasets")
    with pytest.raises(
        ConfigError,
        match=r"config file .*missing\.yaml does not exist; or use a name in jobs/datasets/: laion, sample",
    ):
        resolve_job_file(str(tmp_path / "missing.yaml"), "datasets")


def test_load_config_resolves_names_in_the_real_jobs_folder() -> None:
    names = sorted(p.stem for p in (JOBS_DIR / "datasets").glob("*.yaml"))
    assert names, "jobs/datasets/ holds no YAML: the shipped dataset configs are missing"
    assert resolve_job_file(names[0], "datasets") == JOBS_DIR / "datasets" / f"{names[0]}.yaml"


# ------------------------------------------------------------------------- every job YAML parses
# jobs/<kind>/ -> the dataclass its YAMLs must load into. A module that cannot be imported fails the test
# (a skip would leave every YAML of that kind unchecked while the suite stays green).
JOB_KINDS = {
    "datasets": ("encode.config", "EncodeConfig"),
    "train": ("train.config", "TrainConfig"),
    "estimate": ("shared.estimate", "EstimateConfig"),
}
JOB_FILES = sorted((kind, path) for kind in JOB_KINDS for path in (JOBS_DIR / kind).glob("*.y*ml"))


def job_config_class(kind: str) -> type:
    module_name, class_name = JOB_KINDS[kind]
    return getattr(importlib.import_module(module_name), class_name)


@pytest.mark.parametrize(("kind", "path"), JOB_FILES, ids=[f"{kind}/{path.name}" for kind, path in JOB_FILES])
def test_every_job_yaml_parses_into_its_config(kind: str, path: Path) -> None:
    cls = job_config_class(kind)
    cfg = load_config(cls, path.stem, kind=kind)  # by name, as `make encode DATASET=<name>` does
    assert load_config(cls, config_to_dict(cfg)) == cfg  # and what is saved next to outputs reloads


@pytest.mark.parametrize("kind", sorted(JOB_KINDS))
def test_each_job_kind_has_yamls(kind: str) -> None:
    """Keeps the parse test above from passing vacuously when a folder is empty or renamed."""
    assert isinstance(job_config_class(kind), type)
    assert list((JOBS_DIR / kind).glob("*.y*ml")), f"jobs/{kind}/ holds no YAML files"


def test_a_top_level_typo_of_a_nested_key_suggests_the_dotted_key() -> None:
    """`make train ARGS='lr=1e-4'`: lr lives in optimizer; the message names optimizer.lr."""
    with pytest.raises(
        ConfigError, match=r"^command line: unknown key depht \(did you mean middle\.leaf\.depth\?\)"
    ):
        load_config(Job, overrides=["depht=1"])


def test_an_override_without_equals_gets_an_example_of_this_config() -> None:
    with pytest.raises(ConfigError, match=r"override 'workers' must look like key=value \(e\.g\. name=job\)"):
        load_config(Job, overrides=["workers"])


def test_a_bad_value_from_the_command_line_is_blamed_on_it(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "workers: 3\n")
    with pytest.raises(ConfigError, match=r"^command line: workers must be an integer, got 'abc'"):
        load_config(Job, path, ["workers=abc"])
    bad_file = write_yaml(tmp_path, "workers: abc\n")
    with pytest.raises(ConfigError, match=rf"^{bad_file}: workers must be an integer"):
        load_config(Job, bad_file, ["lr=0.1"])


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"name: [a, b\n", r"is not valid YAML: .* at line 2, column 1"),
        ("name: caf\xe9\n".encode("latin-1"), r"is not UTF-8 text .*save it as UTF-8"),
        (None, r"is a folder; pass a YAML file"),
    ],
    ids=["syntax", "latin-1", "folder"],
)
def test_a_config_file_that_is_not_yaml_is_one_line_naming_it(tmp_path: Path, content, says: str) -> None:
    """A typo in a job file was a yaml ScannerError (or UnicodeDecodeError, IsADirectoryError) traceback."""
    path = tmp_path / "job.yaml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=says):
        load_config(Job, str(path))


def test_an_override_that_is_not_yaml_names_it_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"override 'name=\[a': the value is not valid YAML .*quote it"):
        load_config(Job, None, ["name=[a"])
    with pytest.raises(ConfigError, match=r"inner must be a mapping, got 3"):
        load_config(Job, None, ["inner=3"])
