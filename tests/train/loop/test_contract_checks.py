"""Train refuses data that does not fit the model before building anything, naming both values and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from shared.contract import ContractError
from tests.train.conftest import tiny_config, tiny_overrides, write_fake_dataset
from train.cli import app
from train.loop.prepare import prepare_run


def test_wrong_latent_shape(tmp_path: Path) -> None:
    write_fake_dataset(tmp_path / "data", n=8, partitions=1, latent_shape=(4, 16, 16))
    cfg = tiny_config(str(tmp_path / "data"), tmp_path / "save", tmp_path / "cache")
    with pytest.raises(ContractError, match=r"\[4, 16, 16\].*\[4, 8, 8\]"):
        prepare_run(cfg)


def test_wrong_text_width(tmp_path: Path) -> None:
    write_fake_dataset(tmp_path / "data", n=8, partitions=1, text_shape=(77, 64))
    cfg = tiny_config(str(tmp_path / "data"), tmp_path / "save", tmp_path / "cache")
    with pytest.raises(ContractError, match=r"\[77, 64\].*\[77, 32\]"):
        prepare_run(cfg)


def test_missing_resolution(tiny_dataset: str, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path / "save", tmp_path / "cache", "data.resolution=128")
    with pytest.raises(ContractError, match=r"no 128 px data .*64"):
        prepare_run(cfg)


def test_scale_factor_disagreement(tiny_dataset: str, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path / "save", tmp_path / "cache", "model.scale_factor=0.18215")
    with pytest.raises(ContractError, match="scale factor"):
        prepare_run(cfg)


def test_no_manifest_names_the_fix(tmp_path: Path) -> None:
    cfg = tiny_config(str(tmp_path / "nothing"), tmp_path / "save", tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="make encode"):
        prepare_run(cfg)


def test_cli_prints_the_error_without_a_traceback(tiny_dataset: str, tmp_path: Path) -> None:
    args = tiny_overrides(tiny_dataset, tmp_path / "save", tmp_path / "cache", "data.resolution=128")
    result = CliRunner().invoke(app, ["fit", "tiny", *args])
    assert result.exit_code == 2
    assert "no 128 px data" in result.output and "Traceback" not in result.output


def test_data_smaller_than_one_batch_is_refused(tiny_dataset: str, tmp_path: Path) -> None:
    # Every epoch would be empty with drop_last, and Composer would count epochs forever.
    args = tiny_overrides(tiny_dataset, tmp_path / "save", tmp_path / "cache", "global_batch_size=128")
    result = CliRunner().invoke(app, ["fit", "tiny", *args, "device_microbatch_size=16"])
    assert result.exit_code == 2, result.output
    assert "fewer than one per-rank batch of 128" in result.output and "global_batch_size" in result.output
