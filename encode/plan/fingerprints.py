"""What must be (re)done: fingerprints per stage, done-markers per partition, and what can be reused.

Every output is named by the fingerprints of what produced it:
- `select`: which samples of a partition are kept (filters, caption cleaning, reader options);
- `text`: caption cleaning + text encoder identity (weights hash, backend, tokenizer source) + text.store;
- `image[res]`: resolution, resize/crop + VAE identity (weights hash).
Each fingerprint also includes a code version constant below: bump it when the logic it covers changes, so
outputs made by the old logic are recomputed and never silently mixed with new ones.

A partition is done when its done-marker for the current recipe exists. Otherwise it is encoded, reusing by
key whatever earlier outputs of the same partition still fit: text embeddings whose text fingerprint and raw
caption match, latents whose image fingerprint and source bytes match.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from encode.config import EncodeConfig, EncoderConfig
from encode.plan.integrity import (
    UnsafeOutputError,
    check_shard_entry,
    is_output_dir,
    is_partition_id,
    is_recipe_id,
    marker_location,
)
from encode.sources import Partition
from shared import storage
from shared.buckets import bucket_name, parse_bucket
from shared.contract import CONTRACT_VERSION
from shared.manifest import Layout, fingerprint

# Bump when the code behind a stage changes its output (see module docstring).
DEFAULT_PRECISION = EncoderConfig.precision  # fingerprinted only when another is set
SELECT_CODE_VERSION = 1  # encode/sources.py, encode/process/filters.py
TEXT_CODE_VERSION = 1  # caption cleaning + how the text tower is run
IMAGE_CODE_VERSION = (
    2  # encode/process/images.py decode / resize / crop + how the VAE is run (2: JPEG draft decode)
)

# Done-markers are read with this many concurrent requests.
MARKER_READ_THREADS = 32


@dataclass(frozen=True)
class EncoderIds:
    """Identities of the frozen encoders (weights hashes), computed once per run."""

    vae: str
    text: str
    tokenizer: str


@dataclass(frozen=True)
class StageFingerprints:
    select: str
    text: str
    image: dict[int, str]
    # Bucketed resolutions' bucket lists (transform.buckets); square-only resolutions are absent, so a
    # square-only config fingerprints exactly as before buckets existed. The lists are not in `image`:
    # a latent depends only on its own bucket (checked per key at reuse), the list only on where each
    # image goes, so a changed list re-encodes only the images that move to another bucket.
    buckets: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def output_fingerprint(self, source: str, resolution: int) -> str:
        """Everything that shapes the rows of one partition at one resolution."""
        parts: list[Any] = [CONTRACT_VERSION, source, self.select, self.text, self.image[resolution]]
        if resolution in self.buckets:
            parts.append({"buckets": [list(b) for b in self.buckets[resolution]]})
        return fingerprint(parts)

    def recipe(self, source: str) -> str:
        """Everything that shapes a partition at all resolutions: names its done-marker."""
        parts: list[Any] = [CONTRACT_VERSION, source, self.select, self.text, sorted(self.image.items())]
        if self.buckets:
            lists = {str(r): [list(b) for b in bs] for r, bs in sorted(self.buckets.items())}
            parts.append({"buckets": lists})
        return fingerprint(parts)


def stage_fingerprints(cfg: EncodeConfig, encoders: EncoderIds) -> StageFingerprints:
    src = cfg.source
    reader = {
        "format": src.format,
        "image_exts": src.image_exts,
        "caption_ext": src.caption_ext,
        "columns": [src.image_column, src.caption_column, src.key_column],
        "folder_partitions": src.folder_partitions,
        "budgets": [src.max_sample_bytes, src.max_row_group_bytes, src.max_caption_chars],
    }
    caption = vars(cfg.caption)
    select = fingerprint([SELECT_CODE_VERSION, reader, vars(cfg.filter), caption])
    text_parts: list[Any] = [TEXT_CODE_VERSION, caption, encoders.text, encoders.tokenizer]
    if cfg.text.store != "embeddings":  # appended only then: embeddings datasets keep their fingerprints
        text_parts.append({"store": cfg.text.store})
    # The models' inference settings change their outputs (bf16 moved latent means by 3-6.6 posterior
    # stds, encode/config.py): appended only where not the default, so earlier datasets keep their prints.
    enc = cfg.encoder
    precision = [{"precision": enc.precision}] if enc.precision != DEFAULT_PRECISION else []
    norms = [{"low_precision_norms": True}] if enc.low_precision_norms else []
    text = fingerprint(text_parts + precision)
    image = {
        res: fingerprint(
            [
                IMAGE_CODE_VERSION,
                res,
                cfg.transform.resample,
                cfg.transform.crop,
                encoders.vae,
                *precision,
                *norms,
            ]
        )
        for res in cfg.transform.resolutions
    }
    return StageFingerprints(select, text, image, cfg.transform.bucket_lists(cfg.filter.max_aspect_ratio))


def output_dirname(partition: Partition, output_fp: str) -> str:
    return f"{partition.id}-{output_fp[:12]}"


def _is_timestamp(value: Any) -> bool:
    """An ISO 8601 instant with a UTC offset, as encode writes `finished` (gc and reuse order by it)."""
    try:
        return isinstance(value, str) and datetime.fromisoformat(value).utcoffset() is not None
    except ValueError:
        return False


@dataclass
class DoneMarker:
    """What produced a finished partition, and its counts. Written last: its existence means done."""

    partition: str
    recipe: str
    source: str
    select: str
    text: str
    image: dict[int, str]
    # res -> {"dir": str | None, "num_samples": int, "bytes": int, "shards": [...]}; a bucketed resolution
    # adds "buckets": {"HxW": {"num_samples", "bytes", "shards"}} (shards below <dir>/<HxW>/)
    outputs: dict[int, dict[str, Any]]
    samples_read: int
    rejected: dict[str, int]
    smaller_than_resolution: dict[int, int]
    encoded: dict[str, Any]  # {"text": n, "latents": {res: n}}
    reused: dict[str, Any]  # same shape: what came from earlier outputs
    seconds: float
    finished: str
    # kept samples whose safety score was missing, by reason (markers written before this field: none)
    admitted_unchecked: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = dict(vars(self))
        for name in ("image", "outputs", "smaller_than_resolution"):
            out[name] = {str(k): v for k, v in out[name].items()}
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> DoneMarker:
        obj = dict(obj)
        for name in ("image", "outputs", "smaller_than_resolution"):
            obj[name] = {int(k): v for k, v in obj[name].items()}
        marker = cls(**obj)
        marker.check_names()
        return marker

    def check_names(self) -> None:
        """Every name this marker puts into a path has the form encode writes (UnsafeOutputError if not)."""
        where = f"done-marker of partition {self.partition!r}"
        if not _is_timestamp(self.finished) or not isinstance(self.outputs, dict):
            raise UnsafeOutputError(
                f"{where}: `finished` is not an ISO timestamp with a UTC offset or `outputs` not an object"
            )
        if not is_partition_id(self.partition) or not is_recipe_id(self.recipe):
            raise UnsafeOutputError(f"{where}: recipe {self.recipe!r} or the partition is not an encode id")
        for out in self.outputs.values():
            if not isinstance(out, dict):
                raise UnsafeOutputError(f"{where}: an output is not an object")
            if out.get("dir") is not None and not is_output_dir(out["dir"], self.partition):
                raise UnsafeOutputError(f"{where}: output folder {out['dir']!r} is not this partition's")
            buckets = out.get("buckets") or {}
            if not isinstance(buckets, dict) or not all(_is_bucket_name(b) for b in buckets):
                raise UnsafeOutputError(f"{where}: an output's buckets are not named HxW")
            in_buckets = [s for b in buckets.values() for s in b.get("shards", [])]
            for shard in [*out.get("shards", []), *in_buckets]:
                check_shard_entry(shard, where)


def _is_bucket_name(name: Any) -> bool:
    try:
        return isinstance(name, str) and bucket_name(parse_bucket(name)) == name
    except ValueError:
        return False


@dataclass(frozen=True)
class ReuseSource:
    """An earlier output of this partition at one resolution whose columns can be copied by key."""

    uri: str  # the partition output folder (holds index.json + shards)
    text: bool  # its text embeddings fit the current text fingerprint
    latents: bool  # its latents fit the current image fingerprint at `resolution`
    resolution: int
    bucket: tuple[int, int] | None = None  # a bucketed output: the folder holds this bucket's rows


@dataclass
class PartitionPlan:
    partition: Partition
    source: str  # source fingerprint
    recipe: str
    outputs: dict[int, str]  # res -> output dirname
    done_uri: str | None = None  # this recipe's done-marker, if the partition is finished
    reuse: list[ReuseSource] = field(default_factory=list)

    @property
    def is_done(self) -> bool:
        return self.done_uri is not None


def list_markers(layout: Layout) -> dict[str, dict[str, str]]:
    """partition id -> recipe -> done-marker URI, from one listing (no marker is read).

    Only `<partition id>/<recipe>.json` files with encode's own id forms count; anything else under
    `_parts/` is not a done-marker and is neither trusted nor deleted.
    """
    found: dict[str, dict[str, str]] = defaultdict(dict)
    prefix = layout.parts_dir()
    for info in storage.list_files(prefix):
        parts = storage.relpath(info.uri, prefix).split("/")
        if len(parts) != 2 or not parts[1].endswith(".json"):
            continue
        partition, recipe = parts[0], parts[1].removesuffix(".json")
        if is_partition_id(partition) and is_recipe_id(recipe):
            found[partition][recipe] = info.uri
    return found


@dataclass(frozen=True)
class MarkerReads:
    """Done-markers read back: the good ones, and why each other one could not be used (uri -> reason)."""

    markers: list[DoneMarker]
    unreadable: dict[str, str]


def read_markers(uris: Sequence[str]) -> MarkerReads:
    """Read markers concurrently (on S3, tens of thousands read one by one would take minutes).

    A marker counts only if it is valid JSON of this code's shape, its names have encode's forms, and it
    names the partition and recipe of the place it was found (a copied or planted file does not).
    """
    with ThreadPoolExecutor(MARKER_READ_THREADS) as pool:
        results = list(pool.map(_read_marker, uris))
    good = [r for r in results if isinstance(r, DoneMarker)]
    bad = {uri: r for uri, r in zip(uris, results, strict=True) if isinstance(r, str)}
    return MarkerReads(good, bad)


def load_markers(uris: Sequence[str]) -> list[DoneMarker]:
    """The readable markers among `uris`; an unreadable one is skipped. Only for reuse, where skipping
    one means its work is redone; publishing and gc use `read_markers` and act on the unreadable ones."""
    return read_markers(uris).markers


def _read_marker(uri: str) -> DoneMarker | str:
    try:
        marker = DoneMarker.from_json(storage.read_json(uri))
    except (ValueError, TypeError, KeyError, AttributeError, FileNotFoundError) as err:
        return f"{type(err).__name__}: {err}"
    if (marker.partition, marker.recipe) != marker_location(uri):
        return f"names partition {marker.partition!r} recipe {marker.recipe!r}, not where it was found"
    return marker


def plan_partitions(
    partitions: Sequence[Partition],
    stages: StageFingerprints,
    layout: Layout,
    markers: dict[str, dict[str, str]],
) -> list[PartitionPlan]:
    """Done or to do, per partition; for those to do, which earlier outputs can be reused."""
    plans = []
    for part in partitions:
        source = part.source_fingerprint()
        recipe = stages.recipe(source)
        outputs = {
            res: output_dirname(part, stages.output_fingerprint(source, res)) for res in sorted(stages.image)
        }
        earlier = markers.get(part.id, {})
        plan = PartitionPlan(part, source, recipe, outputs, done_uri=earlier.get(recipe))
        if not plan.is_done and earlier:
            newest_first = sorted(
                load_markers(list(earlier.values())), key=lambda m: m.finished, reverse=True
            )
            plan.reuse = find_reuse(newest_first, stages, source, layout)
        plans.append(plan)
    return plans


def find_reuse(
    earlier: Sequence[DoneMarker], stages: StageFingerprints, source: str, layout: Layout
) -> list[ReuseSource]:
    """Earlier outputs whose text or latents still fit; newest first so the freshest copy wins."""
    found = []
    for marker in earlier:
        text_fits = marker.text == stages.text
        for res, out in marker.outputs.items():
            if not out.get("dir"):
                continue
            latents_fit = (
                res in stages.image and marker.image.get(res) == stages.image[res] and marker.source == source
            )
            if not (text_fits or latents_fit):
                continue
            uri = layout.partition_output(res, out["dir"])
            if "buckets" not in out:
                found.append(ReuseSource(uri, text_fits, latents_fit, res))
            for name in sorted(out.get("buckets") or {}):
                bucket_uri = storage.join(uri, name)
                found.append(ReuseSource(bucket_uri, text_fits, latents_fit, res, parse_bucket(name)))
    return found


def assign_to_rank(partitions: Sequence[Partition], rank: int, world_size: int) -> list[Partition]:
    """Round-robin over the full sorted partition list (done or not), so every rank computes the same
    split without coordination and any rank count covers each partition exactly once."""
    return [p for i, p in enumerate(partitions) if i % world_size == rank]
