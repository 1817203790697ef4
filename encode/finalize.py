"""Publish a dataset version once every partition is done; delete what no kept version needs (`gc`).

Publishing writes, in order: each resolution's merged index under versions/<vid>/, that version's manifest,
the current per-resolution index, metrics.json, and last the root manifest.json (the commit point). Earlier
versions and their partition folders are left alone until `encode gc`, so a training job streaming an older
version keeps working while a new one is encoded and published.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from encode.config import EncodeConfig
from encode.encoders import Encoders
from encode.plan import (
    IMAGE_CODE_VERSION,
    SELECT_CODE_VERSION,
    TEXT_CODE_VERSION,
    DoneMarker,
    PartitionPlan,
    StageFingerprints,
    list_markers,
    load_markers,
    plan_partitions,
    stage_fingerprints,
)
from encode.sources import list_partitions
from shared import storage
from shared.config import config_to_dict
from shared.manifest import INDEX_NAME, DatasetManifest, Layout, ResolutionInfo, fingerprint, read_manifest

log = logging.getLogger("encode")
UNFINISHED_SHOWN = 10


class NotFinishedError(RuntimeError):
    """Some partitions have no done-marker for the current config yet."""


@dataclass
class PublishResult:
    manifest: DatasetManifest
    new_version: bool


def current_plans(cfg: EncodeConfig, encoders: Encoders) -> tuple[list[PartitionPlan], StageFingerprints]:
    layout = Layout(cfg.output.uri)
    stages = stage_fingerprints(cfg, encoders.ids)
    plans = plan_partitions(list_partitions(cfg.source), stages, layout, list_markers(layout))
    return plans, stages


def require_all_done(plans: Sequence[PartitionPlan]) -> list[DoneMarker]:
    missing = [p.partition.id for p in plans if not p.is_done]
    if missing:
        shown = ", ".join(missing[:UNFINISHED_SHOWN]) + (" ..." if len(missing) > UNFINISHED_SHOWN else "")
        raise NotFinishedError(
            f"{len(missing)} of {len(plans)} partitions are not encoded for this config yet ({shown}); "
            "wait for running ranks, or rerun `make encode` (it redoes only unfinished partitions)"
        )
    return load_markers([p.done_uri for p in plans if p.done_uri])


def merged_index(markers: Sequence[DoneMarker], resolution: int) -> dict[str, Any]:
    """One MDS index over every partition's shards (what streaming's `merge_index` makes), in partition order.

    Built from the shard entries each done-marker keeps rather than with `merge_index`, which would read
    every partition's index.json again, and because each version's index lives under versions/<vid>/ while
    its shards stay under the resolution's stream root: basenames are relative to that root.
    """
    shards = []
    for marker in markers:
        out = marker.outputs.get(resolution, {})
        for shard in copy.deepcopy(out.get("shards", [])):
            for part in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
                if shard.get(part):
                    shard[part]["basename"] = f"{out['dir']}/{shard[part]['basename']}"
            shards.append(shard)
    return {"version": 2, "shards": shards}


def dataset_fingerprint(stages: StageFingerprints, markers: Sequence[DoneMarker]) -> str:
    return fingerprint(
        [stages.select, stages.text, sorted(stages.image.items()), [m.recipe for m in markers]]
    )


def build_manifest(
    cfg: EncodeConfig, encoders: Encoders, stages: StageFingerprints, markers: Sequence[DoneMarker], vid: str
) -> DatasetManifest:
    resolutions = {}
    for res in cfg.transform.resolutions:
        outs = [m.outputs.get(res, {}) for m in markers]
        resolutions[res] = ResolutionInfo(
            num_samples=sum(o.get("num_samples", 0) for o in outs),
            shapes=encoders.shapes(res),
            bytes=sum(o.get("bytes", 0) for o in outs),
            smaller_than_resolution=sum(m.smaller_than_resolution.get(res, 0) for m in markers),
            fingerprint=fingerprint([stages.image[res], [o.get("dir") for o in outs]]),
        )
    rejected: Counter[str] = Counter()
    for marker in markers:
        rejected.update(marker.rejected)
    return DatasetManifest(
        version=vid,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        preset=cfg.preset,
        scale_factor=float(encoders.vae.config.scaling_factor),
        resolutions=resolutions,
        rejected=dict(sorted(rejected.items())),
        samples_read=sum(m.samples_read for m in markers),
        fingerprints={
            "dataset": dataset_fingerprint(stages, markers),
            "select": stages.select,
            "text": stages.text,
            "image": {str(r): fp for r, fp in stages.image.items()},
            "encoders": {
                "vae": encoders.ids.vae,
                "text": encoders.ids.text,
                "tokenizer": encoders.ids.tokenizer,
            },
            "code_versions": {
                "select": SELECT_CODE_VERSION,
                "text": TEXT_CODE_VERSION,
                "image": IMAGE_CODE_VERSION,
            },
        },
        empty_caption_embedding=encoders.empty_caption_embedding(),
        partitions=[
            {
                "id": m.partition,
                "recipe": m.recipe,
                "dirs": {str(r): o.get("dir") for r, o in m.outputs.items()},
            }
            for m in markers
        ],
        config=config_to_dict(cfg),
    )


def publish(cfg: EncodeConfig, encoders: Encoders) -> PublishResult:
    """Merge every partition's index into a new version and make it current (no-op if nothing changed)."""
    layout = Layout(cfg.output.uri)
    plans, stages = current_plans(cfg, encoders)
    markers = require_all_done(plans)
    fp = dataset_fingerprint(stages, markers)
    current = _current_manifest(layout)
    if current is not None and current.dataset_fingerprint == fp:
        return PublishResult(current, new_version=False)
    vid = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}-{fp[:8]}"
    manifest = build_manifest(cfg, encoders, stages, markers, vid)
    for res in cfg.transform.resolutions:
        index = merged_index(markers, res)
        storage.write_json(layout.version_index(vid, res), index)
        storage.write_json(layout.current_index(res), index)
    storage.write_json(layout.version_manifest(vid), manifest.to_json())
    storage.write_json(layout.metrics, dataset_metrics(manifest, markers))
    storage.write_json(layout.manifest, manifest.to_json())  # the commit point
    return PublishResult(manifest, new_version=True)


def _current_manifest(layout: Layout) -> DatasetManifest | None:
    try:
        return read_manifest(layout.root)
    except FileNotFoundError:
        return None


def dataset_metrics(manifest: DatasetManifest, markers: Sequence[DoneMarker]) -> dict[str, Any]:
    """Machine-readable totals of the version (per-run throughput is logged by each rank)."""
    per_res = {}
    for res, info in manifest.resolutions.items():
        encoded = sum(m.encoded["latents"].get(str(res), 0) for m in markers)
        reused = sum(m.reused["latents"].get(str(res), 0) for m in markers)
        per_res[str(res)] = {
            "num_samples": info.num_samples,
            "bytes": info.bytes,
            "bytes_per_sample": round(info.bytes / info.num_samples, 1) if info.num_samples else None,
            "smaller_than_resolution": info.smaller_than_resolution,
            "latents_encoded": encoded,
            "latents_reused": reused,
        }
    return {
        "version": manifest.version,
        "samples_read": manifest.samples_read,
        "rejected": manifest.rejected,
        "resolutions": per_res,
        "text_encoded": sum(m.encoded["text"] for m in markers),
        "text_reused": sum(m.reused["text"] for m in markers),
        "partition_seconds": round(sum(m.seconds for m in markers), 3),
    }


@dataclass
class GcReport:
    kept_versions: list[str]
    deleted_versions: list[str]
    deleted_partition_dirs: list[str]
    deleted_markers: int


def list_versions(layout: Layout) -> list[str]:
    """Published version ids, newest first (ids start with a UTC timestamp)."""
    prefix = storage.join(layout.root, "versions")
    vids = {storage.relpath(info.uri, prefix).split("/")[0] for info in storage.list_files(prefix)}
    return sorted(vids, reverse=True)


def collect_garbage(layout: Layout, keep: int = 1, dry_run: bool = False) -> GcReport:
    """Delete versions beyond the `keep` newest (the current one always stays) and unreferenced data.

    Partition folders and done-markers newer than the current version are kept: they belong to an encode
    run in progress or not yet finalized. Do not run gc while a training job streams a version being
    deleted; that is the point of keeping it until you ask.
    """
    current = read_manifest(layout.root)
    versions = list_versions(layout)
    older = [v for v in versions if v != current.version]
    kept = [current.version, *older[: max(keep - 1, 0)]]
    manifests = [read_manifest(layout.root, v) for v in kept]
    wanted_dirs = {(int(r), d) for m in manifests for p in m.partitions for r, d in p["dirs"].items() if d}
    wanted_recipes = {(p["id"], p["recipe"]) for m in manifests for p in m.partitions}
    deleted_markers = 0
    listed = list_markers(layout)
    for marker in load_markers([uri for recipes in listed.values() for uri in recipes.values()]):
        if (marker.partition, marker.recipe) in wanted_recipes:
            continue
        if marker.finished > current.created:  # in-progress work of a newer run
            wanted_dirs |= {(r, o["dir"]) for r, o in marker.outputs.items() if o.get("dir")}
            continue
        deleted_markers += 1
        if not dry_run:  # marker first: a crash mid-gc never leaves a marker naming deleted data
            storage.delete(layout.done_marker(marker.partition, marker.recipe))
    deleted_dirs = _delete_unwanted_dirs(layout, current, wanted_dirs, dry_run)
    stale = [v for v in versions if v not in kept]
    if not dry_run:
        for vid in stale:
            storage.delete_tree(layout.version_dir(vid))
    return GcReport(kept, stale, deleted_dirs, deleted_markers)


def _delete_unwanted_dirs(
    layout: Layout, current: DatasetManifest, wanted: set[tuple[int, str]], dry_run: bool
) -> list[str]:
    deleted = []
    for res in current.resolutions:
        root = layout.stream_root(res)
        dirs = {storage.relpath(i.uri, root).split("/")[0] for i in storage.list_files(root)}
        for dirname in sorted(dirs - {INDEX_NAME}):
            if (res, dirname) in wanted:
                continue
            deleted.append(f"{res}/{dirname}")
            if not dry_run:
                storage.delete_tree(layout.partition_output(res, dirname))
    return deleted
