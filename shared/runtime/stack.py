"""The software stack this project is tested on, and installing it on top of a machine's own torch.

Two installs exist (Makefile `install`): the lock's (`requirements.lock`, torch 2.7.0 from PyPI) and
`TORCH=system`, a GPU image's own torch (and torchvision, triton, CUDA) kept, everything else from the lock.
Composer 0.32.1, the last release, pins torch < 2.7.1, so every GPU image from now on is newer than the lock:
CI runs the training, resume, FSDP-consolidation and export tests on both ends of `TESTED_TORCH`
(`make test-torch-next`, docs/gpu-tests.md).

Standard library only: `requirements` runs under the image's interpreter before anything is installed, so
this is an argparse CLI (typer is not there yet), run as `python -m shared.runtime.stack`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# Inclusive (major, minor) ranges CI runs the suite on: the lock's torch and `TORCH_NEXT` in the Makefile
# (tests/shared/test_stack.py keeps the two in step). CUDA: torch 2.7's PyPI build (12.6) to the first GPU
# image's (13.0, docs/gpu-tests.md).
TESTED_PYTHON = ((3, 11), (3, 12))
TESTED_TORCH = ((2, 7), (2, 11))
TESTED_CUDA = ((12, 6), (13, 0))
ALLOW_UNTESTED_HINT = "ALLOW_UNTESTED=1 (make install) or --allow-untested goes on anyway, at your own risk"

# What a GPU image brings and `TORCH=system` keeps: never downloaded into the wheelhouse, never installed.
IMAGE_PACKAGES = re.compile(r"^(torch|torchvision|triton|nvidia-.*|cuda-.*)$")


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pin_name(line: str) -> str | None:
    """`name==1.0` -> `name`; None for comments and blank lines."""
    line = line.split("#", 1)[0].strip()
    return canonical(re.split(r"[=<>!~;\[ ]", line, maxsplit=1)[0]) if line else None


def lock_without_torch(lock_lines: list[str]) -> list[str]:
    """The lock's pins minus torch, torchvision, triton, nvidia-* and cuda-*."""
    out = []
    for line in lock_lines:
        name = pin_name(line)
        if name and not IMAGE_PACKAGES.match(name):
            out.append(line.strip())
    return out


def in_range(version: tuple[int, int], bounds: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    return bounds[0] <= version <= bounds[1]


def major_minor(version: str) -> tuple[int, int]:
    """ "2.11.0+cu130" -> (2, 11)."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def tested_range() -> str:
    span = lambda b: f"{b[0][0]}.{b[0][1]} to {b[1][0]}.{b[1][1]}"  # noqa: E731
    return f"Python {span(TESTED_PYTHON)}, torch {span(TESTED_TORCH)}, CUDA {span(TESTED_CUDA)} or none"


def stack_problems(python: str, torch: str, cuda: str | None) -> list[str]:
    """What lies outside the tested range (empty when everything is inside)."""
    problems = []
    if not in_range(major_minor(python), TESTED_PYTHON):
        problems.append(f"Python {python}")
    if not in_range(major_minor(torch), TESTED_TORCH):
        problems.append(f"torch {torch}")
    if cuda is not None and not in_range(major_minor(cuda), TESTED_CUDA):
        problems.append(f"CUDA {cuda}")
    return problems


def check(allow_untested: bool) -> int:
    """Print this interpreter's Python / torch / CUDA against the tested range; 1 when outside it."""
    try:
        import torch
        import torchvision
    except ImportError as err:
        print(f"error: {err}: this interpreter has no torch/torchvision to keep; install them into it, or "
              "use the lock's torch (make install without TORCH=system)", file=sys.stderr)  # fmt: skip
        return 1
    python = ".".join(map(str, sys.version_info[:3]))
    found = f"Python {python}, torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), "
    found += f"torchvision {torchvision.__version__}"
    problems = stack_problems(python, torch.__version__, torch.version.cuda)
    if not problems:
        print(f"{found}: inside the tested range ({tested_range()})")
        return 0
    level = "warning" if allow_untested else "error"
    outside = ", ".join(problems)
    print(f"{level}: {found}: {outside} outside the tested range ({tested_range()})", file=sys.stderr)
    if not allow_untested:
        print(f"  {ALLOW_UNTESTED_HINT}", file=sys.stderr)
    return 0 if allow_untested else 1


def write_requirements(lock: Path, out: Path) -> None:
    """The lock without what the image keeps, as a requirements file for pip (`--no-deps`). What torch
    itself needs (sympy, networkx, jinja2, fsspec, filelock, typing-extensions) comes from the lock too:
    the rest of the stack was tested with those pins, and they satisfy torch 2.11's requirements."""
    lines = lock_without_torch(lock.read_text().splitlines())
    out.write_text("\n".join(lines) + "\n")
    print(f"{out}: {len(lines)} pins from {lock}, without torch, torchvision, triton, nvidia-*, cuda-*")


def site_dirs() -> list[str]:
    """This interpreter's own site-packages: a venv made from a venv interpreter does not see them."""
    import sysconfig

    paths = sysconfig.get_paths()
    return list(dict.fromkeys(p for p in (paths["purelib"], paths["platlib"]) if Path(p).is_dir()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shared.runtime.stack", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    req = sub.add_parser("requirements", help="the lock without torch & co, for a wheelhouse or an install")
    req.add_argument("--lock", type=Path, default=Path("requirements.lock"))
    req.add_argument("--out", type=Path, required=True)
    sub.add_parser("site-dirs", help="this interpreter's site-packages, one a line")
    chk = sub.add_parser("check", help="torch, CUDA and Python inside the tested range?")
    chk.add_argument("--allow-untested", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "requirements":
        write_requirements(args.lock, args.out)
        return 0
    if args.command == "site-dirs":
        print("\n".join(site_dirs()))
        return 0
    return check(args.allow_untested)


if __name__ == "__main__":
    sys.exit(main())
