"""`encode gc`: delete dataset versions beyond the kept ones, and the partition outputs and done-markers no
kept (or leased) version uses.

Only what the listing found inside the dataset root is deleted, by the URI it was found at
(encode/plan/integrity.py). A version a training job holds an unexpired lease on stays unless `--force`
(shared/leases.py). Work of an encode in progress stays: done-markers newer than the current version, and
partition folders written in the last `min_age_s` (an encode uploads a partition's files before its
done-marker, for minutes on S3). Rank claims left by killed encodes go once lapsed for twice their TTL
(encode/plan/claims.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime

from encode.plan.claims import lapsed_claims
from encode.plan.fingerprints import list_markers, read_markers
from encode.plan.integrity import is_inside, is_output_dir, is_version_id, marker_location
from shared import storage
from shared.leases import live_leases
from shared.manifest import INDEX_NAME, DatasetManifest, Layout, read_manifest

log = logging.getLogger("encode")


@dataclass
class GcReport:
    kept_versions: list[str]
    deleted_versions: list[str]
    deleted_partition_dirs: list[str]
    deleted_markers: int
    # done-markers that cannot be read (uri -> reason): left in place, with the data they may name
    unreadable_markers: dict[str, str] = field(default_factory=dict)
    # listed paths that resolve outside the dataset root (links): never deleted
    refused: list[str] = field(default_factory=list)
    # version -> the jobs holding an unexpired lease on it (shared/leases.py)
    leased: dict[str, list[str]] = field(default_factory=dict)
    # leased versions deleted anyway (--force)
    forced: list[str] = field(default_factory=list)
    # unreferenced partition folders written in the last min_age_s: left for an encode that may be uploading
    recent: list[str] = field(default_factory=list)
    min_age_s: float = 0.0
    # rank claims of encodes killed long ago (_claims/rank-R-of-W.json)
    deleted_claims: list[str] = field(default_factory=list)


def list_versions(layout: Layout) -> list[str]:
    """Published version ids, newest first (ids start with a UTC timestamp); other names are ignored."""
    prefix = storage.join(layout.root, "versions")
    vids = {storage.relpath(info.uri, prefix).split("/")[0] for info in storage.list_files(prefix)}
    return sorted((v for v in vids if is_version_id(v)), reverse=True)


def collect_garbage(
    layout: Layout,
    keep: int = 1,
    dry_run: bool = False,
    force: bool = False,
    now: float | None = None,
    min_age_s: float = 0.0,
) -> GcReport:
    """Delete versions beyond the `keep` newest (the current one always stays) and unreferenced data.

    A version a training job holds an unexpired lease on (it streams it) is kept too, unless `force`.

    Partition folders and done-markers newer than the current version are kept: they belong to an encode
    run in progress or not yet finalized. So are partition folders no marker names yet but written in the
    last `min_age_s`: an encode uploads a partition's files before its marker (`encode gc`: an hour).
    Only what the listing found inside the dataset root is deleted, by the URI it was found at: nothing a
    marker's contents name is ever turned into a path to delete.
    """
    current = read_manifest(layout.root)
    versions = list_versions(layout)
    older = [v for v in versions if v != current.version]
    kept = [current.version, *older[: max(keep - 1, 0)]]
    leases = live_leases(layout.root, now, remove_lapsed=not dry_run)
    clock = time.time() if now is None else now
    leased = {v: [lease.describe(clock) for lease in leases[v]] for v in versions if v in leases}
    held = [v for v in older if v in leased and v not in kept]
    if not force:
        kept += held
    manifests = [read_manifest(layout.root, v) for v in kept]
    wanted_dirs = {(int(r), d) for m in manifests for p in m.partitions for r, d in p["dirs"].items() if d}
    wanted_recipes = {(p["id"], p["recipe"]) for m in manifests for p in m.partitions}
    listed = [uri for recipes in list_markers(layout).values() for uri in recipes.values()]
    reads = read_markers(listed)
    by_location = {marker_location(uri): uri for uri in listed}
    deleted_markers, refused = 0, []
    for marker in reads.markers:
        if (marker.partition, marker.recipe) in wanted_recipes:
            continue
        if finished_after(marker.finished, current.created):  # in-progress work of a newer run
            wanted_dirs |= {(r, o["dir"]) for r, o in marker.outputs.items() if o.get("dir")}
            continue
        deleted_markers += 1
        if not dry_run:  # marker first: a crash mid-gc never leaves a marker naming deleted data
            _delete_inside(layout, by_location[(marker.partition, marker.recipe)], False, refused)
    for uri in reads.unreadable:
        log.warning("gc leaves unreadable done-marker %s alone (delete it by hand once checked)", uri)
    named = {int(r) for marker in reads.markers for r in marker.outputs}  # dropped resolutions too
    # Folders a marker names are finished work; only one no marker names yet may be an upload in progress.
    marked = {
        (int(r), o["dir"]) for marker in reads.markers for r, o in marker.outputs.items() if o.get("dir")
    }
    unmarked_since = clock - min_age_s
    deleted_dirs, recent = _delete_unwanted_dirs(
        layout, current, named, wanted_dirs, dry_run, refused, marked, unmarked_since
    )
    stale = [v for v in versions if v not in kept]
    if not dry_run:
        for vid in stale:
            _delete_inside(layout, layout.version_dir(vid), True, refused)
    forced = held if force else []
    claims = lapsed_claims(layout, clock)
    if not dry_run:
        for uri in claims:
            _delete_inside(layout, uri, False, refused)
    return GcReport(
        kept,
        stale,
        deleted_dirs,
        deleted_markers,
        reads.unreadable,
        refused,
        leased,
        forced,
        recent,
        min_age_s,
        claims,
    )


def finished_after(finished: str, created: str) -> bool:
    """Whether a done-marker finished after a version was created, compared as instants.

    Compared as strings, a marker finished in the same second as a manifest written with second precision
    (before this was fixed) sorted after it ("56.2+00:00" > "56+00:00"), so gc kept a finished, replaced
    partition as if a newer run owned it. Such an old `created` is still read as the start of its second,
    which keeps same-second markers: a marker gc keeps is deleted by a later gc, one it deletes is gone.
    """
    return datetime.fromisoformat(finished) > datetime.fromisoformat(created)


def describe_gc(report: GcReport, dry_run: bool) -> list[str]:
    """What `encode gc` prints: kept versions (and which job leases each), then what went."""
    verb = "would delete" if dry_run else "deleted"
    lines = [f"kept versions: {', '.join(report.kept_versions)}"]
    for vid, jobs in sorted(report.leased.items()):
        state = "DELETED despite --force" if vid in report.forced else "kept"
        lines += [f"  {vid} {state}: leased by {job}" for job in jobs]
    lines.append(
        f"{verb} {len(report.deleted_versions)} versions, {len(report.deleted_partition_dirs)} "
        f"partition folders, {report.deleted_markers} done-markers"
    )
    lines += [f"  {name}" for name in report.deleted_partition_dirs]
    if n := len(report.deleted_claims):
        what = "claim of an encode rank that ended" if n == 1 else "claims of encode ranks that ended"
        lines.append(f"{verb} {n} {what} without releasing {'it' if n == 1 else 'them'}")
    lines += [
        f"left alone (unreadable done-marker): {uri}: {why}" for uri, why in report.unreadable_markers.items()
    ]
    lines += [f"left alone (outside the dataset root): {uri}" for uri in report.refused]
    lines += [
        f"left alone (no done-marker yet, written in the last {report.min_age_s / 60:g} min: an encode may "
        f"be uploading it): {name}"
        for name in report.recent
    ]
    return lines


def _delete_unwanted_dirs(
    layout: Layout,
    current: DatasetManifest,
    resolutions: set[int],
    wanted: set[tuple[int, str]],
    dry_run: bool,
    refused: list[str],
    marked: set[tuple[int, str]],
    unmarked_since: float,
) -> tuple[list[str], list[str]]:
    """Partition output folders (by encode's own naming) that no kept version or newer marker uses, and a
    root index the current version has none of (dropped, or bucketed now): it names folders that go here.
    Returns them, and the folders left alone: no marker names them and they were written after
    `unmarked_since`."""
    deleted, recent = [], []
    for res in sorted(resolutions | set(current.resolutions)):
        root = layout.stream_root(res)
        files = storage.list_files(root)
        info = current.resolutions.get(res)
        if (info is None or info.buckets is not None) and any(
            i.uri == layout.current_index(res) for i in files
        ):
            deleted.append(f"{res}/{INDEX_NAME}")
            if not dry_run:
                _delete_inside(layout, layout.current_index(res), False, refused)
        newest: dict[str, float] = {}
        for info in files:
            name = storage.relpath(info.uri, root).split("/")[0]
            newest[name] = max(newest.get(name, 0.0), info.modified)
        for dirname in sorted(d for d in newest if is_output_dir(d)):
            if (res, dirname) in wanted:
                continue
            if (res, dirname) not in marked and newest[dirname] > unmarked_since:  # its marker may be to come
                recent.append(f"{res}/{dirname}")
                continue
            deleted.append(f"{res}/{dirname}")
            if not dry_run:
                _delete_inside(layout, layout.partition_output(res, dirname), True, refused)
    return deleted, recent


def _delete_inside(layout: Layout, uri: str, tree: bool, refused: list[str]) -> None:
    """Delete `uri` (a file, or a folder with `tree`) only if it lies inside the dataset root (a link
    leading out of it, or a planted name, is left alone and reported in `refused`)."""
    if not is_inside(layout.root, uri):
        log.warning("gc leaves %s alone: it is not inside the dataset root %s", uri, layout.root)
        refused.append(uri)
        return
    (storage.delete_tree if tree else storage.delete)(uri)
