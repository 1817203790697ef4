"""Hostile encode outputs: whoever can write the output bucket must not run code or delete outside it.

A stored partition folder and a done-marker are read back by the next re-encode, `finalize` and `gc`; these
tests plant what an attacker (or a broken tool) could write there and check that nothing runs, nothing
outside the dataset is touched and no good data is lost.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from encode.pipeline import RankInfo, run_rank
from encode.plan.reuse import UnsafeOutputError, iter_mds_rows, open_mds_readers
from encode.process.encoders import Encoders, load_encoders
from encode.publish.finalize import UnreadableMarkersError, publish
from encode.publish.gc import collect_garbage
from encode.sample_data import build_webdataset
from shared import contract
from shared.manifest import Layout, read_manifest
from tests.encode.test_pipeline import LOW, encode, make_cfg, rows_by_key

PER_SHARD = 8


class Canary:
    """Unpickling this creates a file: proof that a stored row was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


@pytest.fixture(scope="module")
def encoders() -> Encoders:
    return load_encoders(make_cfg("unused", "unused"))


@pytest.fixture(scope="module")
def wds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wds")
    build_webdataset(out, shards=1, per_shard=PER_SHARD, seed=5)
    return out


def plant_pickle_column(folder: Path, canary: Path) -> None:
    """Rewrite a partition output with the same rows plus an undeclared `pkl` column."""
    from streaming import MDSWriter

    rows = [dict(r) for r in iter_mds_rows(folder)]
    first = json.loads((folder / "index.json").read_text())["shards"][0]
    columns = dict(zip(first["column_names"], first["column_encodings"], strict=True))
    shutil.rmtree(folder)
    with MDSWriter(out=str(folder), columns={**columns, "evil": "pkl"}) as writer:
        for row in rows:
            writer.write({**row, "evil": Canary(canary)})


def test_reuse_refuses_a_pickle_column_and_reencodes_instead(
    wds: Path, tmp_path: Path, encoders: Encoders
) -> None:
    out, canary = tmp_path / "out", tmp_path / "code-ran"
    _, first = encode(make_cfg(wds, out), encoders)
    rows = first.manifest.resolutions[LOW].num_samples
    (part,) = first.manifest.partitions
    plant_pickle_column(Path(Layout(str(out)).partition_output(LOW, part["dirs"][str(LOW)])), canary)
    # A caption change re-runs the partition, reusing latents by key from the (now planted) folder.
    _, second = encode(make_cfg(wds, out, "caption.max_chars=12"), encoders)
    assert not canary.exists(), "a stored pkl column was unpickled"
    assert second.manifest.resolutions[LOW].num_samples == rows
    assert encoders.images_encoded >= rows, "the planted folder's latents were reused instead of redone"


def test_open_mds_readers_refuses_undeclared_columns_and_paths(tmp_path: Path) -> None:
    from streaming import MDSWriter

    shapes = contract.Shapes((4, 2, 2), (3, 8))
    good = tmp_path / "good"
    with MDSWriter(out=str(good), columns=contract.mds_columns(shapes)) as writer:
        zeros = np.zeros
        writer.write(contract.make_row("k", "c", zeros((4, 2, 2)), zeros((4, 2, 2)), zeros((3, 8))))
    assert len(open_mds_readers(good, str(tmp_path / "scratch"), shapes)) == 1
    index = json.loads((good / "index.json").read_text())
    with pytest.raises(UnsafeOutputError, match="latent_mean"):
        open_mds_readers(
            good, str(tmp_path / "scratch"), contract.Shapes((4, 4, 4), (3, 8))
        )  # wrong shape for this preset
    index["shards"][0]["raw_data"]["basename"] = "../../escape.mds"
    (good / "index.json").write_text(json.dumps(index))
    with pytest.raises(UnsafeOutputError, match="plain file name"):
        open_mds_readers(good, str(tmp_path / "scratch"), shapes)


def test_gc_deletes_nothing_a_planted_marker_names(wds: Path, tmp_path: Path, encoders: Encoders) -> None:
    out = tmp_path / "data" / "out"
    _, first = encode(make_cfg(wds, out), encoders)
    (part,) = first.manifest.partitions
    layout = Layout(str(out))
    real = json.loads(Path(layout.done_marker(part["id"], part["recipe"])).read_text())
    # Issue 14.4: a marker at _parts/zzz/ naming "../../victim" made gc delete <out>/../victim/<recipe>.json
    victim = tmp_path / "data" / "victim" / f"{part['recipe']}.json"
    victim.parent.mkdir(parents=True)
    victim.write_text("precious")
    outside_dir = tmp_path / "elsewhere"
    outside_dir.mkdir()
    (outside_dir / "keep.txt").write_text("precious")
    planted = {**real, "partition": "../../victim", "finished": "2000-01-01T00:00:00.000000+00:00"}
    for name in ("planted", "0123456789abcdef"):  # a free-form name and one shaped like a recipe
        (out / "_parts" / "zzz").mkdir(parents=True, exist_ok=True)
        (out / "_parts" / "zzz" / f"{name}.json").write_text(json.dumps(planted))
    escaping = {**real, "outputs": {str(LOW): {"dir": "../../elsewhere", "num_samples": 1, "bytes": 1}}}
    (out / "_parts" / "zzz" / "fedcba9876543210.json").write_text(json.dumps(escaping))
    # A link shaped like an output folder (a file: the listing does not descend into linked folders).
    (out / str(LOW) / "zzz-0123456789ab").symlink_to(outside_dir / "keep.txt")
    report = collect_garbage(layout, keep=1)
    assert victim.read_text() == "precious"
    assert (outside_dir / "keep.txt").read_text() == "precious"
    assert report.deleted_markers == 0
    assert len(report.unreadable_markers) == 2  # the recipe-shaped ones; "planted.json" is not a marker
    assert any("zzz-0123456789ab" in uri for uri in report.refused)
    assert len(rows_by_key(out, LOW)) == first.manifest.resolutions[LOW].num_samples


def test_publish_fails_naming_a_partition_whose_marker_is_unreadable(
    wds: Path, tmp_path: Path, encoders: Encoders
) -> None:
    out = tmp_path / "out"
    cfg = make_cfg(wds, out)
    _, first = encode(cfg, encoders)
    (part,) = first.manifest.partitions
    marker = Path(Layout(str(out)).done_marker(part["id"], part["recipe"]))
    marker.write_text('{"partition": "truncated')  # e.g. a tool that rewrote it and died halfway
    changed = make_cfg(wds, out, "caption.max_chars=12")  # a config whose version would be new
    run_rank(changed, RankInfo(0, 1), encoders)
    changed_marker = next(p for p in marker.parent.iterdir() if p != marker)
    changed_marker.write_text("not json")
    with pytest.raises(UnreadableMarkersError, match=f"(?s){part['id']}.*Delete these marker files"):
        publish(changed, encoders)
    assert read_manifest(str(out)).version == first.manifest.version, "a version without it was published"
