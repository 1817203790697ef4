"""The layout the README's Development section promises, checked from the source with `ast`:
shared/ imports neither train, encode nor composer; encode imports neither train nor composer; no import
cycles between modules; no module over MAX_LINES lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "encode", "train")
MAX_LINES = 400
FORBIDDEN = {
    "shared": ("train", "encode", "composer"),
    "encode": ("train", "composer"),
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
