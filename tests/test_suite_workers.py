"""The suite's own scheduling (tests/conftest.py group_for_workers): under `make test`'s pytest-xdist workers
each test carries its group, so a module's tests share one worker and its module fixtures are built once.

Nothing fails when grouping silently stops (pytest 9.2 and xdist 3.8 dropped the group suffix; a worker's
options never say `-n`): fixtures are just built again on the other worker, and the suite gets slower.
"""

from __future__ import annotations

import pytest


def test_under_xdist_a_test_is_scheduled_with_its_module(request: pytest.FixtureRequest) -> None:
    if not hasattr(request.config, "workerinput"):
        pytest.skip("not under pytest-xdist (make test runs it there)")
    module = request.node.nodeid.split("::")[0]
    assert request.node.nodeid.endswith(f"@{module}"), request.node.nodeid
