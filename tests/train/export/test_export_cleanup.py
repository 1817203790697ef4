"""Export leaves no scratch behind (issue 10.6): the downloaded s3:// checkpoint (~14 GB for SD2-base), the
staged pipeline for an s3:// output and the per-process tokenizer folders are removed, also on error.

Each test points `tempfile` at its own empty folder, so "nothing left" is checked exactly, whatever other
processes on the machine do in the shared temp dir.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from shared import storage
from shared.models import build_tokenizer
from shared.presets import get_preset
from tests.train.conftest import TinyRun
from train.checkpoints.files import LATEST_NAME, SYMLINK_SUFFIX
from train.export.pipeline import ExportError, export_pipeline


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def upload_checkpoint(local: Path, save: str, name: str = "ep1-ba12-rank0.pt") -> None:
    """Place a checkpoint in an s3:// save folder the way Composer does (file + latest pointer)."""
    storage.write_bytes(f"{save}/{name}", local.read_bytes())
    _, prefix = storage.split_s3(save)
    storage.write_bytes(f"{save}/{LATEST_NAME}{SYMLINK_SUFFIX}", f"{prefix}/{name}".encode())


def test_building_the_tokenizer_leaves_no_folder(private_tmp: Path) -> None:
    build_tokenizer(get_preset("tiny"))
    assert list(private_tmp.iterdir()) == []


@pytest.mark.s3
def test_export_from_and_to_s3_leaves_no_scratch(
    tiny_run: TinyRun, s3_prefix: str, private_tmp: Path
) -> None:
    save = f"{s3_prefix}/run"
    upload_checkpoint(tiny_run.save / LATEST_NAME, save)
    result = export_pipeline(save, f"{s3_prefix}/export")
    assert result.checkpoint == f"{save}/ep1-ba12-rank0.pt"
    assert storage.exists(f"{s3_prefix}/export/model_index.json")
    assert list(private_tmp.iterdir()) == []


@pytest.mark.s3
def test_failed_export_leaves_no_scratch(s3_prefix: str, tmp_path: Path, private_tmp: Path) -> None:
    save, plain = f"{s3_prefix}/run", tmp_path / "plain.pt"
    torch.save(
        {"state": {"model": {}}}, plain
    )  # loads fine, but has no RunRecord: export fails after download
    upload_checkpoint(plain, save)
    with pytest.raises(ExportError, match="RunRecord"):
        export_pipeline(save, str(tmp_path / "out"))
    assert list(private_tmp.iterdir()) == []
