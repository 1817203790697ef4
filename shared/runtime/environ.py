"""Environment variables changed for the length of a block, then as they were (set, changed or removed)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


@contextmanager
def restored_environ(names: Iterable[str]) -> Iterator[None]:
    """The named variables get back their values from before the block (unset if they were unset)."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
