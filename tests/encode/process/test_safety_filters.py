"""Safety filters never pass a sample silently for lack of a score (issue 10.7).

A sample without a usable punsafe / pwatermark value is counted under `punsafe_missing` /
`pwatermark_missing` (kept by default) or dropped under that reason with `filter.missing_safety=reject`.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from encode.config import FilterConfig
from encode.process.encoders import Encoders, load_encoders
from encode.process.filters import missing_safety_reasons
from encode.sample_data import build_webdataset
from tests.encode.test_pipeline import LOW, encode, make_cfg

PER_SHARD = 12
STRIPPED = 4  # samples whose .json loses its punsafe score


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        ({"punsafe": 0.05, "pwatermark": 0.2}, []),
        ({}, ["punsafe_missing", "pwatermark_missing"]),
        ({"PUNSAFE": "0.01"}, ["pwatermark_missing"]),  # LAION spelling, numeric string: present
        ({"punsafe": float("nan"), "pwatermark": "n/a"}, ["punsafe_missing", "pwatermark_missing"]),
        ({"punsafe": None, "pwatermark": True}, ["punsafe_missing", "pwatermark_missing"]),
    ],
)
def test_missing_scores_are_named(meta: dict, expected: list[str]) -> None:
    assert missing_safety_reasons(meta, FilterConfig()) == expected


def test_disabled_checks_count_nothing_missing() -> None:
    assert missing_safety_reasons({}, FilterConfig(max_punsafe=None, max_pwatermark=None)) == []


def strip_punsafe(tar_path: Path, count: int) -> None:
    """Rewrite a webdataset tar with `punsafe` removed from the first `count` samples' .json."""
    members = []
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            members.append((member, tar.extractfile(member).read()))  # type: ignore[union-attr]
    stripped = 0
    with tarfile.open(tar_path, "w") as tar:
        for member, data in members:
            if member.name.endswith(".json") and stripped < count:
                meta = json.loads(data)
                if meta.get("punsafe", 1.0) <= 0.1:  # a sample the filter would otherwise keep
                    meta.pop("punsafe")
                    data = json.dumps(meta).encode()
                    stripped += 1
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    assert stripped == count


@pytest.fixture(scope="module")
def encoders() -> Encoders:
    return load_encoders(make_cfg("unused", "unused"))


def test_missing_punsafe_is_counted_or_rejected(tmp_path: Path, encoders: Encoders) -> None:
    (tar_path,) = build_webdataset(tmp_path / "in", shards=1, per_shard=PER_SHARD, seed=9)
    _, base = encode(make_cfg(tmp_path / "in", tmp_path / "base"), encoders)
    strip_punsafe(tar_path, STRIPPED)
    _, admitted = encode(make_cfg(tmp_path / "in", tmp_path / "admit"), encoders)
    manifest = admitted.manifest
    assert manifest.extra["admitted_unchecked"] == {"punsafe_missing": STRIPPED}
    assert manifest.resolutions[LOW].num_samples == base.manifest.resolutions[LOW].num_samples
    _, rejected = encode(
        make_cfg(tmp_path / "in", tmp_path / "reject", "filter.missing_safety=reject"), encoders
    )
    manifest = rejected.manifest
    assert manifest.rejected["punsafe_missing"] == STRIPPED
    assert manifest.extra["admitted_unchecked"] == {}
    assert manifest.resolutions[LOW].num_samples <= base.manifest.resolutions[LOW].num_samples - 1
