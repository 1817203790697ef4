"""The suite's leftover check (tests/leftovers.py finish_run): what a run leaves in its temp folder is named
and removed; a Manager folder a library's server left when it was ended at shutdown is named apart, as
tolerated, so SD_TESTS_STRICT_LEFTOVERS=1 (CI) fails on the project's leftovers only."""

from __future__ import annotations

from pathlib import Path

from tests.leftovers import Run, finish_run


def test_leftovers_are_named_and_removed_and_an_ended_managers_folder_is_only_tolerated(
    tmp_path: Path,
) -> None:
    temp = tmp_path / "run"
    (temp / "pymp-ended").mkdir(parents=True)
    (temp / "pymp-ended" / "listener-abc").touch()  # a Manager server's socket, the server gone
    (temp / "pymp-busy").mkdir()
    (temp / "pymp-busy" / "checkpoint.pt").touch()  # not a Manager's: the project's leftover
    (temp / "tmpabc").mkdir()
    (temp / "reuse-x").touch()
    left, tolerated = finish_run(Run(tmp_path, temp), basetemp=None)
    assert len(left) == 1 and "3 entr(y/ies)" in left[0]
    assert all(name in left[0] for name in ("pymp-busy", "reuse-x", "tmpabc")) and "pymp-ended" not in left[0]
    assert len(tolerated) == 1 and "pymp-ended" in tolerated[0]
    assert not list(temp.iterdir())
    assert finish_run(Run(tmp_path, temp, checks=False), basetemp=None) == ([], [])
