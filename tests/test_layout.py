"""The layout the README's Development section promises, checked from the source with `ast`:
shared/ imports neither train, encode nor composer; encode imports neither train nor composer; inside train/
and encode/ each concern package imports only the packages declared below it in LAYERS (function-local
imports count); no import cycles between modules; no module over MAX_LINES lines; no folder over
MAX_MODULES modules; every package's `__init__` says what it owns."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "encode", "train")
MAX_LINES = 400
MAX_MODULES = 12  # per folder, besides __init__ and __main__
FORBIDDEN = {
    "shared": ("train", "encode", "composer"),
    "encode": ("train", "composer"),
}


# The import direction inside each stage, lowest first: a package (or top-level module) may import its own
# modules, the packages before it in this order and shared/, never one after it. Entries in one tuple are
# peers and may not import each other. Mirrored in the README's Development tree.
LAYERS: dict[str, list[tuple[str, ...]]] = {
    "train": [
        ("config",),  # the job's typed config
        ("data",),  # streaming, draws, packing, leases
        ("model",),  # U-Net assembly, objective, online text tower
        ("ema",),  # EMA stores, sharded EMA, handoff
        ("checkpoints",),  # read/consolidate checkpoints, run record, retention
        ("export",),  # diffusers export, sample grids
        ("eval",),  # held-out loss, `train eval`, `train eval-images`
        ("resilience",),  # save/stop at a step boundary, heartbeats, exit records, plan numbers
        ("loop",),  # trainer stages, lean step, clipping, guards, metrics
        ("bench", "tools"),  # make bench; demo and tiny-vae
        ("launch",),  # the job's launch description
        ("cli",),
        ("__main__",),
    ],
    "encode": [
        ("config",),
        ("sources", "sample_data"),
        ("plan",),  # fingerprints, done-markers, integrity, reuse
        ("process",),  # per-sample path: prepare, images, filters, encoders, writer
        ("publish",),  # finalize a version, gc
        ("pipeline",),
        ("report",),
        ("precision",),  # low-precision latents against strict fp32, for the bench and vae_speed
        ("bench", "launch"),
        ("vae_speed",),  # the VAE encoder alone with each speed switch, for train's make bench
        ("cli",),
        ("__main__",),
    ],
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def imported_names(path: Path) -> set[str]:
    """Every module an import statement in `path` names, at any depth (function-local imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def project_edges() -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a import b` counts `a.b` when that is a module)."""
    known = modules()
    return {name: {d for d in imported_names(path) if d in known} - {name} for name, path in known.items()}


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_stage_boundaries(package: str) -> None:
    bad = {
        name: sorted(dep for dep in imported_names(path) if top(dep) in FORBIDDEN[package])
        for name, path in modules().items()
        if top(name) == package
    }
    assert not {name: deps for name, deps in bad.items() if deps}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative DFS, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(edges):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(edges[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return None


def test_no_import_cycles() -> None:
    # A package's __init__ re-exporting its submodules is not a cycle of the design: a submodule importing
    # a sibling by its full name never goes through the package's __init__ body again.
    edges = project_edges()
    for name in edges:
        if (REPO / name.replace(".", "/") / "__init__.py").exists():
            edges[name] = {dep for dep in edges[name] if not dep.startswith(name + ".")}
    assert find_cycle(edges) is None


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_module_over_the_line_limit() -> None:
    lines = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not long, f"split these modules (at most {MAX_LINES} lines): {long}"


def unit_of(name: str) -> str:
    """The concern a module belongs to: `train.ema.store` -> `ema`, `train.config` -> `config`."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_index(stage: str) -> dict[str, int]:
    return {unit: i for i, units in enumerate(LAYERS[stage]) for unit in units}


@pytest.mark.parametrize("stage", sorted(LAYERS))
def test_every_concern_has_a_declared_layer(stage: str) -> None:
    units = {unit_of(name) for name in modules() if top(name) == stage} - {""}
    assert units <= set(layer_index(stage)), (
        f"declare these in LAYERS[{stage!r}]: {units - set(layer_index(stage))}"
    )


@pytest.mark.parametrize("stage", sorted(LAYERS))
def test_import_direction(stage: str) -> None:
    index = layer_index(stage)
    upward = sorted(
        f"{name} -> {dep}"
        for name, deps in project_edges().items()
        if top(name) == stage and unit_of(name)
        for dep in deps
        if top(dep) == stage
        and unit_of(dep)
        and unit_of(dep) != unit_of(name)
        and index[unit_of(dep)] >= index[unit_of(name)]
    )
    assert not upward, f"imports against the declared direction (tests/test_layout.py LAYERS): {upward}"


def test_no_folder_over_the_module_limit() -> None:
    folders = {
        p for pkg in PACKAGES for p in (REPO / pkg).rglob("*") if p.is_dir() and p.name != "__pycache__"
    }
    counts = {
        str(folder.relative_to(REPO)): sum(
            1 for f in folder.glob("*.py") if f.stem not in ("__init__", "__main__")
        )
        for folder in folders | {REPO / pkg for pkg in PACKAGES}
    }
    crowded = {folder: n for folder, n in counts.items() if n > MAX_MODULES}
    assert not crowded, f"group these folders by concern (at most {MAX_MODULES} modules each): {crowded}"


def test_every_package_says_what_it_owns() -> None:
    silent = sorted(
        str(init.relative_to(REPO))
        for pkg in PACKAGES
        for init in (REPO / pkg).rglob("__init__.py")
        if not ast.get_docstring(ast.parse(init.read_text()))
    )
    assert not silent, f"give these packages a one-line docstring saying what they own: {silent}"


def test_direction_check_catches_an_upward_import() -> None:
    index = layer_index("train")
    assert index["loop"] > index["ema"] and index["cli"] > index["loop"]
    assert unit_of("train.ema.store") == "ema" and unit_of("train.config") == "config"


def test_every_test_file_the_docs_cite_exists() -> None:
    """Tests moved into subfolders left 17 cited paths behind: `pytest <path>` from the docs found no file."""
    import re

    cited = {
        (doc.name, path)
        for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
        for path in re.findall(r"\btests/[\w/]+\.py\b", doc.read_text())
    }
    missing = sorted((doc, path) for doc, path in cited if not (REPO / path).is_file())
    assert not missing, f"cited test files that do not exist: {missing}"
