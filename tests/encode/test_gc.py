"""`encode gc` keeps versions that running training jobs hold leases on (issue 10.5)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from encode.cli import app
from encode.encoders import Encoders, load_encoders
from encode.finalize import collect_garbage, describe_gc
from encode.sample_data import build_webdataset
from shared import leases
from shared.manifest import Layout, read_manifest
from tests.encode.test_pipeline import encode, make_cfg

HOUR_S = 3600


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str, str]:
    """A dataset with an older version (v1) and the current one (v2), encoded once per module."""
    base = tmp_path_factory.mktemp("gc")
    build_webdataset(base / "in", shards=1, per_shard=8, seed=4)
    encoders: Encoders = load_encoders(make_cfg("unused", "unused"))
    _, v1 = encode(make_cfg(base / "in", base / "out"), encoders)
    _, v2 = encode(make_cfg(base / "in", base / "out", "transform.resample=bilinear"), encoders)
    return base / "in", base / "out", v1.manifest.version, v2.manifest.version


@pytest.fixture
def dataset(two_versions: tuple[Path, Path, str, str], tmp_path: Path) -> tuple[Path, Path, str, str]:
    src, out, v1, v2 = two_versions
    shutil.copytree(out, tmp_path / "out")
    return src, tmp_path / "out", v1, v2


def test_gc_keeps_a_leased_version_and_names_the_job(dataset: tuple[Path, Path, str, str]) -> None:
    _, out, v1, _ = dataset
    leases.write_lease(str(out), "run-7-host-1", v1, "sd2-phase1-run-7")
    report = collect_garbage(Layout(str(out)), keep=1)
    assert v1 in report.kept_versions and not report.deleted_versions
    assert read_manifest(str(out), v1).version == v1
    printed = "\n".join(describe_gc(report, dry_run=False))
    assert f"{v1} kept: leased by job sd2-phase1-run-7" in printed


def test_gc_ignores_expired_leases(dataset: tuple[Path, Path, str, str]) -> None:
    _, out, v1, _ = dataset
    leases.write_lease(str(out), "crashed", v1, "crashed-run", ttl_s=60, now=time.time() - HOUR_S)
    report = collect_garbage(Layout(str(out)), keep=1)
    assert report.deleted_versions == [v1] and not report.leased


def test_gc_force_deletes_a_leased_version_through_the_cli(dataset: tuple[Path, Path, str, str]) -> None:
    src, out, v1, v2 = dataset
    leases.write_lease(str(out), "live", v1, "live-run")
    args = ["gc", "sample", f"source.uri={src}", f"output.uri={out}"]
    kept = CliRunner().invoke(app, args)
    assert kept.exit_code == 0, kept.output
    assert "leased by job live-run" in kept.output
    assert read_manifest(str(out), v1).version == v1
    forced = CliRunner().invoke(app, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert "live-run" in forced.output and "--force" in forced.output
    with pytest.raises(FileNotFoundError):
        read_manifest(str(out), v1)
    assert read_manifest(str(out)).version == v2


def test_lease_names_are_validated(tmp_path: Path) -> None:
    with pytest.raises(leases.LeaseError):
        leases.lease_uri(str(tmp_path), "../../etc/x")
    name = leases.lease_name("my run/../x", host="h", pid=1)
    assert "/" not in name and ".." not in name
    (tmp_path / "_leases").mkdir()
    (tmp_path / "_leases" / "junk.json").write_text("{not json")
    found, unreadable = leases.list_leases(str(tmp_path))
    assert found == [] and list(unreadable) == [str(tmp_path / "_leases" / "junk.json")]
