"""A finished run asked to continue (`make train` right after `make demo`) says so and how to go on."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from shared.launch import control
from tests.train.conftest import TinyRun, tiny_config, tiny_overrides
from train.cli import app
from train.loop.prepare import RunFinishedError, check_not_finished


@pytest.mark.parametrize(
    ("latest", "max_duration", "finished"),
    [
        ("/runs/demo/ep46-ba600-rank0.pt", "600ba", True),
        ("s3://b/runs/demo/ep46-ba600-rank0.pt", "500ba", True),
        ("/runs/demo/ep46-ba600/", "600ba", True),  # a sharded checkpoint folder
        ("/runs/demo/ep23-ba300-rank0.pt", "600ba", False),
        ("/runs/demo/ep46-ba600-rank0.pt", "50ep", False),  # epochs: Composer's own check applies
    ],
)
def test_finished_is_read_from_the_checkpoint_name(
    tmp_path: Path, latest: str, max_duration: str, finished: bool
) -> None:
    cfg = tiny_config("/data", tmp_path / "save", tmp_path / "cache", f"max_duration={max_duration}")
    if not finished:
        check_not_finished(cfg, latest)
        return
    with pytest.raises(RunFinishedError) as info:
        check_not_finished(cfg, latest)
    assert "already finished: its latest checkpoint is at 600ba" in str(info.value)
    assert "max_duration=1200ba" in str(info.value) and "save_folder=" in str(info.value)


def test_fit_on_a_finished_run_prints_two_lines_and_no_traceback(
    tiny_run: TinyRun, tiny_dataset: str, tmp_path: Path
) -> None:
    """Stops before a model or data loader is built (the demo's case was a 50-line Composer traceback)."""
    args = tiny_overrides(tiny_dataset, tiny_run.save, tmp_path / "cache", "max_duration=12ba")
    supervised = tmp_path / "control"  # as under the supervisor, which reads why the ranks stopped
    supervised.mkdir()
    result = CliRunner().invoke(app, ["fit", "tiny", *args], env={control.CONTROL_DIR_ENV: str(supervised)})
    assert result.exit_code == 2, result.output
    # "finished", not "fatal": after a crash at the run's end the supervisor's restart ends done (exit 0)
    assert control.read_json(supervised / control.EXIT_FILE)["state"] == "finished"
    assert "Traceback" not in result.output and result.exception is not None  # typer.Exit, nothing else
    lines = [line for line in result.output.splitlines() if line.strip() and " INFO " not in line]
    assert lines[-2].startswith("error: the run in ") and "already finished" in lines[-2]
    assert "make train ARGS='max_duration=24ba'" in lines[-1]
