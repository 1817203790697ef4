"""What a missing source says: the bundled sample data names the command that builds it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from encode.cli import app
from encode.config import SourceConfig
from encode.sources.listing import list_partitions


def test_missing_sample_data_names_the_command_that_builds_it(tmp_path: Path, monkeypatch) -> None:
    """`make encode DATASET=sample` on a fresh clone: outputs/demo/sample-data/ does not exist yet."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "sample"])
    assert result.exit_code != 0
    message = str(result.exception) + result.output
    assert "outputs/demo/sample-data/webdataset does not exist" in message
    assert "python -m encode sample-data --out outputs/demo/sample-data" in message and "make demo" in message


def test_other_missing_sources_say_check_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist or holds no files; check the path$"):
        list_partitions(SourceConfig(uri=str(tmp_path / "nowhere"), format="webdataset"))
