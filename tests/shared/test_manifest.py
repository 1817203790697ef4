"""shared/manifest.py: the dataset manifest's JSON round trip, read_manifest and the on-storage layout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from shared import storage
from shared.contract import CONTRACT_VERSION, ContractError, Shapes, mds_columns
from shared.manifest import (
    DatasetManifest,
    Layout,
    ResolutionInfo,
    decode_array,
    encode_array,
    fingerprint,
    read_manifest,
)

EMPTY_EMBEDDING_SHAPE = (77, 32)


def make_manifest(version: str = "v0001") -> DatasetManifest:
    rng = np.random.default_rng(0)
    return DatasetManifest(
        version=version,
        created="2025-01-01T00:00:00Z",
        preset="tiny",
        scale_factor=0.18215,
        resolutions={
            256: ResolutionInfo(10, Shapes((4, 32, 32), (77, 32)), 12345, 3, "fp256"),
            512: ResolutionInfo(4, Shapes((4, 64, 64), (77, 32)), 67890, 9, "fp512"),
        },
        rejected={"too_small": 2, "punsafe": 1},
        samples_read=15,
        fingerprints={"dataset": "abc123", "text": {"encoder": "transformers:ff"}},
        empty_caption_embedding=rng.standard_normal(EMPTY_EMBEDDING_SHAPE).astype(np.float16),
        partitions=[{"name": "00000", "rows": 14}],
        config={"name": "sample", "transform": {"resolutions": [256, 512]}},
        extra={"note": "ü"},
    )


def assert_same_manifest(got: DatasetManifest, want: DatasetManifest) -> None:
    """Field by field: dataclass == on an ndarray field would raise instead of comparing."""
    for name in want.__dataclass_fields__:
        if name == "empty_caption_embedding":
            assert got.empty_caption_embedding.dtype == want.empty_caption_embedding.dtype
            np.testing.assert_array_equal(got.empty_caption_embedding, want.empty_caption_embedding)
        else:
            assert getattr(got, name) == getattr(want, name), name


# --------------------------------------------------------------------------------------------- JSON
def test_manifest_json_round_trip() -> None:
    manifest = make_manifest()
    as_json = json.loads(json.dumps(manifest.to_json()))  # really through JSON text
    assert_same_manifest(DatasetManifest.from_json(as_json), manifest)


def test_manifest_json_carries_counts_schema_and_base64_embedding() -> None:
    manifest = make_manifest()
    obj = manifest.to_json()
    assert obj["contract_version"] == CONTRACT_VERSION
    assert obj["num_samples"] == {"256": 10, "512": 4}
    assert obj["schema"]["512"] == mds_columns(Shapes((4, 64, 64), (77, 32)))
    assert obj["resolutions"]["256"]["shapes"] == {"latent": [4, 32, 32], "text": [77, 32]}
    embedding = obj["empty_caption_embedding"]
    assert embedding["dtype"] == "float16" and embedding["shape"] == list(EMPTY_EMBEDDING_SHAPE)
    assert isinstance(embedding["base64"], str)
    assert manifest.dataset_fingerprint == "abc123"
    assert manifest.num_samples(512) == 4


def test_encode_array_round_trip_is_exact_and_writable() -> None:
    for array in (
        np.arange(12, dtype=np.float16).reshape(3, 4) / 7,
        np.zeros((0, 5), np.float32),
        np.arange(6, dtype=np.float32).reshape(2, 3).T,  # not contiguous
    ):
        back = decode_array(json.loads(json.dumps(encode_array(array))))
        assert back.dtype == array.dtype and back.shape == array.shape
        np.testing.assert_array_equal(back, array)
        back[...] = 0  # a copy, not a read-only view of the decoded bytes


def test_fingerprint_is_stable_and_order_independent() -> None:
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert re.fullmatch(r"[0-9a-f]{16}", fingerprint({"path": Path("/x")}))


# ------------------------------------------------------------------------------------ read_manifest
@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "s3":
        return request.getfixturevalue("s3_prefix")
    return str(tmp_path / "dataset")


def test_read_manifest_current_and_older_version(root: str) -> None:
    layout = Layout(root)
    old, new = make_manifest("v0001"), make_manifest("v0002")
    storage.write_json(layout.version_manifest("v0001"), old.to_json())
    storage.write_json(layout.version_manifest("v0002"), new.to_json())
    storage.write_json(layout.manifest, new.to_json())
    assert_same_manifest(read_manifest(root), new)
    assert_same_manifest(read_manifest(root, version="v0001"), old)


def test_read_manifest_missing_says_what_to_point_at(root: str) -> None:
    with pytest.raises(FileNotFoundError) as info:
        read_manifest(root)
    message = str(info.value)
    assert f"no dataset manifest at {Layout(root).manifest}" in message
    assert "output.uri" in message and "make encode" in message and "finalize" in message
    with pytest.raises(FileNotFoundError, match=re.escape(Layout(root).version_manifest("v9"))):
        read_manifest(root, version="v9")


# ------------------------------------------------------------------------------------------ Layout
def test_layout_paths_on_s3() -> None:
    layout = Layout("s3://bucket/datasets/laion/")
    assert layout.manifest == "s3://bucket/datasets/laion/manifest.json"
    assert layout.metrics == "s3://bucket/datasets/laion/metrics.json"
    assert layout.version_dir("v2") == "s3://bucket/datasets/laion/versions/v2"
    assert layout.version_manifest("v2") == "s3://bucket/datasets/laion/versions/v2/manifest.json"
    assert layout.version_index("v2", 256) == "s3://bucket/datasets/laion/versions/v2/256/index.json"
    assert layout.stream_root(256) == "s3://bucket/datasets/laion/256"
    assert layout.current_index(512) == "s3://bucket/datasets/laion/512/index.json"
    assert layout.partition_output(256, "00007-abcd") == "s3://bucket/datasets/laion/256/00007-abcd"
    assert layout.parts_dir() == "s3://bucket/datasets/laion/_parts"
    assert layout.done_marker("00007", "r1") == "s3://bucket/datasets/laion/_parts/00007/r1.json"


def test_layout_paths_local(tmp_path: Path) -> None:
    layout = Layout(str(tmp_path))
    assert Path(layout.manifest) == tmp_path / "manifest.json"
    assert Path(layout.metrics) == tmp_path / "metrics.json"
    assert Path(layout.version_manifest("v2")) == tmp_path / "versions" / "v2" / "manifest.json"
    assert Path(layout.version_index("v2", 256)) == tmp_path / "versions" / "v2" / "256" / "index.json"
    assert Path(layout.current_index(256)) == tmp_path / "256" / "index.json"
    assert Path(layout.partition_output(256, "p-fp")) == tmp_path / "256" / "p-fp"
    assert Path(layout.done_marker("p", "r")) == tmp_path / "_parts" / "p" / "r.json"


def test_every_index_sits_the_same_depth_below_a_stream_root() -> None:
    """Current and older indexes name shards by the same relative path under `<root>/<res>/`."""
    layout = Layout("s3://b/ds")
    current = storage.relpath(layout.current_index(256), layout.stream_root(256))
    older = storage.relpath(layout.version_index("v1", 256), storage.join(layout.version_dir("v1"), "256"))
    assert current == older == "index.json"


@pytest.mark.parametrize("content", [b"", b'{"version": "v1", "pres'], ids=["empty", "cut-short"])
def test_a_damaged_manifest_is_one_contract_error_naming_it(tmp_path: Path, content: bytes) -> None:
    """It was a JSONDecodeError traceback in train fit, encode gc and encode run (at publish)."""
    (tmp_path / "manifest.json").write_bytes(content)
    with pytest.raises(ContractError, match=r"manifest.json is not a readable manifest .*restore it"):
        read_manifest(str(tmp_path))
