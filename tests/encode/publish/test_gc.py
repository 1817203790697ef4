"""`encode gc` keeps versions that running training jobs hold leases on (issue 10.5)."""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from encode.cli import app
from encode.process.encoders import Encoders, load_encoders
from encode.publish.gc import collect_garbage, describe_gc
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


def test_gc_removes_leases_that_lapsed_long_ago(dataset: tuple[Path, Path, str, str]) -> None:
    """Each restart of a run (a kill -9 never releases) left its lease file next to the data, forever."""
    _, out, v1, _ = dataset
    now = 1_000_000_000.0
    leases.write_lease(str(out), "dead", v1, "dead-run", now=now - 2 * leases.LEASE_TTL_S - 10)
    leases.write_lease(str(out), "lapsed", v1, "lapsed-run", now=now - leases.LEASE_TTL_S - 10)
    leases.write_lease(str(out), "live", v1, "live-run", now=now - 10)
    collect_garbage(Layout(str(out)), keep=1, dry_run=True, now=now)
    assert len(leases.list_leases(str(out))[0]) == 3  # a dry run deletes nothing
    report = collect_garbage(Layout(str(out)), keep=1, now=now)
    assert sorted(lease.job for lease in leases.list_leases(str(out))[0]) == ["lapsed-run", "live-run"]
    assert v1 in report.leased  # the live lease still holds its version


def test_gc_removes_encode_claims_that_lapsed_long_ago(dataset: tuple[Path, Path, str, str]) -> None:
    """A rank killed -9 never releases its claim: it stayed in _claims/ for good, one file per rank of each
    rank count ever killed, and every later rank of another rank count read it at its start."""
    from dataclasses import replace

    from encode.plan.claims import CLAIM_TTL_S, claim_name
    from shared import claims, storage

    _, out, _, _ = dataset
    layout = Layout(str(out))
    now = time.time()
    mine = replace(claims.this_claim("encode sample"), host="node-7")
    for rank, age in [(0, 2 * CLAIM_TTL_S + 10), (1, CLAIM_TTL_S + 10), (2, 10)]:
        claims.write_claim(f"{layout.claims_dir()}/{claim_name(rank, 3)}", replace(mine, written=now - age))
    (out / "_claims" / "notes.txt").write_text("not encode's")
    report = collect_garbage(layout, keep=1, dry_run=True, now=now)
    assert [uri.rsplit("/", 1)[-1] for uri in report.deleted_claims] == [claim_name(0, 3)]
    assert "would delete 1 claim of an encode rank that ended without releasing it" in "\n".join(
        describe_gc(report, dry_run=True)
    )
    assert len(list((out / "_claims").iterdir())) == 4, "a dry run deletes nothing"
    collect_garbage(layout, keep=1, now=now)
    left = sorted(info.uri.rsplit("/", 1)[-1] for info in storage.list_files(layout.claims_dir()))
    assert left == ["notes.txt", claim_name(1, 3), claim_name(2, 3)], "lapsed lately or live: kept"


def test_lease_names_are_validated(tmp_path: Path) -> None:
    with pytest.raises(leases.LeaseError):
        leases.lease_uri(str(tmp_path), "../../etc/x")
    name = leases.lease_name("my run/../x", host="h")
    assert "/" not in name and ".." not in name
    (tmp_path / "_leases").mkdir()
    (tmp_path / "_leases" / "junk.json").write_text("{not json")
    found, unreadable = leases.list_leases(str(tmp_path))
    assert found == [] and list(unreadable) == [str(tmp_path / "_leases" / "junk.json")]


def _set_marker_times(out: Path, finished: str) -> list[Path]:
    """Give every done-marker the current version does not use the `finished` time; returns them."""
    used = {(p["id"], p["recipe"]) for p in read_manifest(str(out)).partitions}
    changed = []
    for path in sorted((out / "_parts").rglob("*.json")):
        marker = json.loads(path.read_text())
        if (marker["partition"], marker["recipe"]) not in used:
            path.write_text(json.dumps({**marker, "finished": finished}))
            changed.append(path)
    assert changed
    return changed


def test_gc_deletes_markers_that_finished_in_the_same_second_before_the_version(
    dataset: tuple[Path, Path, str, str],
) -> None:
    """Flaked under load: the manifest's `created` was cut to the second and compared as a string, so an
    older partition finished within the second before the new version looked like a newer run's work."""
    _, out, v1, _ = dataset
    written = read_manifest(str(out)).created
    assert "." in written, written  # to the microsecond, as markers' `finished` (it was cut to the second)
    created = datetime.fromisoformat(written)
    just_before = (created - timedelta(microseconds=1)).isoformat(timespec="microseconds")
    replaced = _set_marker_times(out, just_before)
    report = collect_garbage(Layout(str(out)), keep=1)
    assert report.deleted_versions == [v1]
    assert report.deleted_markers == len(replaced) and report.deleted_partition_dirs
    assert not any(path.exists() for path in replaced)


def test_gc_keeps_markers_finished_after_the_version_and_refuses_unreadable_times(
    dataset: tuple[Path, Path, str, str],
) -> None:
    out = dataset[1]
    created = datetime.fromisoformat(read_manifest(str(out)).created)
    after = (created + timedelta(microseconds=1)).isoformat(timespec="microseconds")
    newer = _set_marker_times(out, after)  # a newer run's finished partitions, not yet published
    report = collect_garbage(Layout(str(out)), keep=1)
    assert report.deleted_markers == 0 and all(path.exists() for path in newer)
    _set_marker_times(out, "yesterday")  # a marker is data: a time that does not parse is refused
    report = collect_garbage(Layout(str(out)), keep=1)
    assert report.deleted_markers == 0 and len(report.unreadable_markers) == len(newer)


def test_gc_leaves_a_partition_folder_an_encode_may_still_be_uploading(
    dataset: tuple[Path, Path, str, str],
) -> None:
    """An encode uploads a partition's files before its done-marker (minutes on S3): gc took such a folder
    for unreferenced and deleted it, and the encode then published a version naming missing shards."""
    _, out, _, _ = dataset
    uploading = out / "32" / "00000-tar-0123456789ab"  # encode's own naming, no marker yet
    uploading.mkdir(parents=True)
    (uploading / "shard.00000.mds").write_bytes(b"half a partition")
    report = collect_garbage(Layout(str(out)), keep=1, min_age_s=HOUR_S)
    assert report.recent == ["32/00000-tar-0123456789ab"] and uploading.is_dir()  # not the replaced ones
    assert "32/00000-tar-0123456789ab" not in report.deleted_partition_dirs
    assert "no done-marker yet, written in the last 60 min" in "\n".join(describe_gc(report, dry_run=False))
    later = collect_garbage(Layout(str(out)), keep=1, min_age_s=HOUR_S, now=time.time() + 2 * HOUR_S)
    assert "32/00000-tar-0123456789ab" in later.deleted_partition_dirs and not uploading.exists()
