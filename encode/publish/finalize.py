"""Publish a dataset version once every partition is done (`gc`, in encode/publish/gc.py, deletes what no
kept version needs).

Publishing writes, in order: each resolution's merged index under versions/<vid>/, that version's manifest,
the current per-resolution index, metrics.json, and last the root manifest.json (the commit point). Earlier
versions and their partition folders are left alone until `encode gc`, so a training job streaming an older
version keeps working while a new one is encoded and published; gc also keeps every version a running job
holds an unexpired lease on (shared/leases.py, written by train/data/lease.py) unless `--force`.

Publishing never drops a finished partition: a done-marker that cannot be read stops it with an error
naming the marker. gc deletes only what it listed inside the dataset root (encode/plan/integrity.py).
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from encode.config import EncodeConfig
from encode.plan.fingerprints import (
    IMAGE_CODE_VERSION,
    SELECT_CODE_VERSION,
    TEXT_CODE_VERSION,
    DoneMarker,
    PartitionPlan,
    StageFingerprints,
    list_markers,
    plan_partitions,
    read_markers,
    stage_fingerprints,
)
from encode.plan.integrity import marker_location
from encode.process.encoders import Encoders
from encode.sources import list_partitions
from shared import storage
from shared.buckets import bucket_name
from shared.config import config_to_dict
from shared.encoders import TOKENS
from shared.manifest import DatasetManifest, Layout, ResolutionInfo, fingerprint, read_manifest

log = logging.getLogger("encode")
UNFINISHED_SHOWN = 10


class NotFinishedError(RuntimeError):
    """Some partitions have no done-marker for the current config yet."""


class UnreadableMarkersError(NotFinishedError):
    """Some finished partitions' done-markers cannot be used: a version without them would drop their data."""

    def __init__(self, unreadable: dict[str, str]) -> None:
        shown = sorted(unreadable.items())[:UNFINISHED_SHOWN]
        lines = "\n".join(f"  {uri}: {reason}" for uri, reason in shown)
        more = f"\n  ... and {len(unreadable) - len(shown)} more" if len(unreadable) > len(shown) else ""
        partitions = sorted({marker_location(uri)[0] for uri in unreadable})
        super().__init__(
            f"{len(unreadable)} done-markers cannot be read, so partitions {', '.join(partitions[:10])} "
            f"would be missing from the new version; nothing was published:\n{lines}{more}\n"
            "Delete these marker files and rerun `make encode` (it redoes only those partitions)."
        )
        self.unreadable = unreadable


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
    reads = read_markers([p.done_uri for p in plans if p.done_uri])
    if reads.unreadable:
        raise UnreadableMarkersError(reads.unreadable)
    return reads.markers


def merged_index(markers: Sequence[DoneMarker], resolution: int, bucket: str | None = None) -> dict[str, Any]:
    """One MDS index over every partition's shards (what streaming's `merge_index` makes), in partition order.

    Built from the shard entries each done-marker keeps rather than with `merge_index`, which would read
    every partition's index.json again, and because each version's index lives under versions/<vid>/ while
    its shards stay under the resolution's stream root: basenames are relative to that root. `bucket`: one
    bucket's index of a bucketed resolution (its shards sit in `<dir>/<HxW>/`).
    """
    shards = []
    for marker in markers:
        out = marker.outputs.get(resolution, {})
        folder, entries = out.get("dir"), out.get("shards", [])
        if bucket is not None:
            folder = f"{folder}/{bucket}"
            entries = (out.get("buckets") or {}).get(bucket, {}).get("shards", [])
        for shard in copy.deepcopy(entries):
            for part in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
                if shard.get(part):
                    shard[part]["basename"] = f"{folder}/{shard[part]['basename']}"
            shards.append(shard)
    return {"version": 2, "shards": shards}


def bucket_counts(
    buckets: Sequence[tuple[int, int]], outs: Sequence[dict[str, Any]]
) -> dict[str, dict[str, int]]:
    """ "HxW" -> samples and bytes over every partition, for each configured bucket (empty ones too)."""
    counts = {}
    for bucket in buckets:
        name = bucket_name(bucket)
        got = [(o.get("buckets") or {}).get(name, {}) for o in outs]
        counts[name] = {
            "num_samples": sum(int(g.get("num_samples", 0)) for g in got),
            "bytes": sum(int(g.get("bytes", 0)) for g in got),
        }
    return counts


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
        shapes = encoders.shapes(res, cfg.text.store)
        resolutions[res] = ResolutionInfo(
            num_samples=sum(o.get("num_samples", 0) for o in outs),
            shapes=replace(shapes, bucketed=True) if res in stages.buckets else shapes,
            bytes=sum(o.get("bytes", 0) for o in outs),
            smaller_than_resolution=sum(m.smaller_than_resolution.get(res, 0) for m in markers),
            fingerprint=fingerprint([stages.image[res], [o.get("dir") for o in outs]]),
            buckets=bucket_counts(stages.buckets[res], outs) if res in stages.buckets else None,
        )
    identity = encoders.identity(cfg)
    rejected: Counter[str] = Counter()
    unchecked: Counter[str] = Counter()
    for marker in markers:
        rejected.update(marker.rejected)
        unchecked.update(marker.admitted_unchecked)
    return DatasetManifest(
        version=vid,
        # Microseconds, as done-markers' `finished`: gc tells a newer run's markers from older ones by it
        created=datetime.now(UTC).isoformat(timespec="microseconds"),
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
            "encoders": identity.fingerprints(),
            "code_versions": {
                "select": SELECT_CODE_VERSION,
                "text": TEXT_CODE_VERSION,
                "image": IMAGE_CODE_VERSION,
            },
        },
        empty_caption_embedding=encoders.empty_caption_embedding(),
        encoder=identity,
        empty_caption_tokens=encoders.empty_caption_tokens() if identity.text_store == TOKENS else None,
        partitions=[
            {
                "id": m.partition,
                "recipe": m.recipe,
                "dirs": {str(r): o.get("dir") for r, o in m.outputs.items()},
            }
            for m in markers
        ],
        config=config_to_dict(cfg),
        # kept although a safety check had no score to test (filter.missing_safety=admit)
        extra={"admitted_unchecked": dict(sorted(unchecked.items()))},
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
        for name in manifest.resolutions[res].buckets or {}:
            storage.write_json(layout.bucket_index(vid, res, name), merged_index(markers, res, name))
        if manifest.resolutions[res].buckets is not None:
            continue  # no one index: Streaming reads a bucketed resolution as one stream per bucket
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
            **({"buckets": info.buckets} if info.buckets is not None else {}),
        }
    return {
        "version": manifest.version,
        "samples_read": manifest.samples_read,
        "rejected": manifest.rejected,
        "admitted_unchecked": manifest.extra.get("admitted_unchecked", {}),
        "resolutions": per_res,
        "text_encoded": sum(m.encoded["text"] for m in markers),
        "text_reused": sum(m.reused["text"] for m in markers),
        "partition_seconds": round(sum(m.seconds for m in markers), 3),
    }
