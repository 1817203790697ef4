"""encode/plan/reuse.py: an earlier output on S3 is read by the names its index gives, not from a listing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from encode.plan.fingerprints import ReuseSource
from encode.plan.reuse import load_reuse_table
from shared import storage
from shared.contract import Shapes, make_row, mds_columns

SHAPES = Shapes(latent=(4, 4, 4), text=(77, 32))
ROWS = 12


def write_output(folder: Path) -> None:
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    # a shard per 4 rows: several files, so a listing that misses some would lose rows
    with MDSWriter(out=str(folder), columns=mds_columns(SHAPES), size_limit=1 << 14) as writer:
        for i in range(ROWS):
            mean = rng.standard_normal(SHAPES.latent).astype(np.float32)
            text = rng.standard_normal(SHAPES.text).astype(np.float32)
            writer.write(make_row(f"k{i:03d}", f"caption {i}", mean, mean - 4, text))


@pytest.mark.s3
def test_an_s3_output_is_reused_whole_even_when_a_listing_misses_its_files(
    s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_output(tmp_path / "out")
    assert len(list((tmp_path / "out").glob("*.mds"))) > 1
    uri = storage.join(s3_prefix, "part")
    storage.upload_dir(tmp_path / "out", uri)
    monkeypatch.setattr(storage, "list_files", lambda prefix: [])  # a listing that saw nothing yet
    table = load_reuse_table([ReuseSource(uri, text=True, latents=True, resolution=32)])
    try:
        assert sorted(table.text) == [f"k{i:03d}" for i in range(ROWS)]
        assert len(table.latents[32]) == ROWS
    finally:
        table.close()


@pytest.mark.s3
def test_an_s3_output_without_its_index_is_gone(s3_prefix: str) -> None:
    table = load_reuse_table(
        [ReuseSource(storage.join(s3_prefix, "gc"), text=True, latents=True, resolution=32)]
    )
    table.close()
    assert table.text == {} and table.latents == {}


@pytest.mark.s3
def test_a_reuse_table_that_fails_to_load_leaves_no_copies_behind(
    s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outage halfway through copying an S3 output's shards: the copies made so far stayed in the temp
    folder for good (the failed load returned no table to close)."""
    import tempfile

    write_output(tmp_path / "out")
    uri = storage.join(s3_prefix, "out")
    storage.upload_dir(tmp_path / "out", uri)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    copied = []
    real_download = storage.download

    def outage_after_one(src: str, dest: Path) -> None:
        if copied:
            raise storage.StorageError(f"S3 is not answering: {src}")
        real_download(src, dest)
        copied.append(src)

    monkeypatch.setattr(storage, "download", outage_after_one)
    with pytest.raises(storage.StorageError, match="not answering"):
        load_reuse_table([ReuseSource(uri, text=True, latents=True, resolution=32)])
    assert copied and not list(temp.iterdir())
