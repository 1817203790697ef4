"""The data side of encoding, run in worker processes: read, select, decode once, resize; or reuse.

Each worker takes whole partitions and yields, in input order, its kept samples in `PreparedBatch`es of
`encoder.batch_size` and a final `PartitionEnd` with the partition's counts. The main process only runs the
models and writes. A failure that is not about one sample (the input file vanished, S3 is down) ends the
partition with `error` set: its staged output is dropped and no done-marker is written, so a rerun retries it.
"""

from __future__ import annotations

import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch.utils.data

from encode.config import EncodeConfig
from encode.plan.fingerprints import PartitionPlan
from encode.plan.reuse import ReuseTable, load_reuse_table
from encode.process.filters import (
    caption_reject_reason,
    clean_caption,
    metadata_reject_reason,
    missing_safety_reasons,
    size_reject_reason,
)
from encode.process.images import ImageRejected, probe_size, resize_for_resolutions
from encode.sources import RawSample, Rejected, SourceError, read_partition
from shared import contract
from shared.buckets import Bucket, cover_box, nearest_bucket
from shared.presets import get_preset

Geometry = tuple[Bucket, tuple[int, int], tuple[float, float, float, float]]


@dataclass
class PreparedSample:
    partition: str
    key: str
    caption: str  # raw, as stored in the MDS `caption` column
    text_input: str  # cleaned: what the text encoder sees
    text_embedding: np.ndarray | None  # reused (token ids with text.store=tokens), or None: to encode
    pixels: dict[int, np.ndarray] = field(default_factory=dict)  # res -> uint8 HWC, to encode
    latents: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # res -> reused
    # bucketed resolutions only: res -> (bucket (H, W), upright source size (H, W), crop box in source px)
    geometry: dict[int, Geometry] = field(default_factory=dict)


@dataclass
class PartitionEnd:
    partition: str
    samples_read: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    smaller_than_resolution: Counter[int] = field(default_factory=Counter)
    # kept samples a safety check passed only because their score was missing (filter.missing_safety)
    admitted_unchecked: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    error: str | None = None
    # the error is the source config's (SourceError: a missing or wrong column), not this partition's: a
    # rerun cannot get past it, so the job stops on it with its one line
    config_error: bool = False


@dataclass
class _Selected:
    caption: str
    text_input: str
    size: tuple[int, int]
    unchecked: list[str]  # safety checks passed for lack of a score, e.g. ["punsafe_missing"]


def select_sample(sample: RawSample, cfg: EncodeConfig) -> _Selected | str:
    """The sample's cleaned caption and size, or the reason it is dropped (first failing check wins)."""
    # A file or tar member name that is not UTF-8: no MDS row can hold its key (it crashed the writer).
    if not key_is_utf8(sample.key):
        return "key_not_utf8"
    if sample.image is None or not sample.image:
        return "missing_image" if sample.image is None else "empty_image_file"
    if sample.caption is None:
        return "missing_caption"
    caption = sample.caption[: cfg.source.max_caption_chars]  # stored this way too (see SourceConfig)
    text_input = clean_caption(caption, cfg.caption)
    reason = caption_reject_reason(text_input, cfg.filter) or metadata_reject_reason(sample.meta, cfg.filter)
    if reason:
        return reason
    unchecked = missing_safety_reasons(sample.meta, cfg.filter)
    if unchecked and cfg.filter.missing_safety == "reject":
        return unchecked[0]
    try:
        size = probe_size(sample.image, cfg.filter.max_pixels)
    except ImageRejected as err:
        return err.reason
    reason = size_reject_reason(size[0], size[1], cfg.filter)
    return reason or _Selected(caption, text_input, size, unchecked)


def key_is_utf8(key: str | None) -> bool:
    try:
        (key or "").encode("utf-8")
    except UnicodeEncodeError:  # Python holds undecodable name bytes as surrogates
        return False
    return True


def prepare_sample(
    sample: RawSample,
    chosen: _Selected,
    plan: PartitionPlan,
    reuse: ReuseTable,
    cfg: EncodeConfig,
    end: PartitionEnd,
) -> PreparedSample | None:
    """Reuse what fits, decode once for the rest; None if the image turns out undecodable or fits no
    resolution."""
    out = PreparedSample(
        plan.partition.id,
        sample.key,
        chosen.caption,
        chosen.text_input,
        reuse.text_for(sample.key, chosen.caption),
    )
    width, height = chosen.size
    lists = cfg.transform.bucket_lists(cfg.filter.max_aspect_ratio)
    wanted, buckets = [], {}
    for res in cfg.transform.resolutions:
        if res in lists:
            bucket = nearest_bucket(width, height, lists[res])
            box = cover_box(width, height, bucket)
            fits = box is not None
        else:
            fits = min(width, height) >= res
        if not fits:
            end.smaller_than_resolution[res] += 1  # never upscaled: simply absent at this resolution
            continue
        if res in lists:
            buckets[res] = bucket
            out.geometry[res] = (bucket, (height, width), box)  # type: ignore[assignment]
        hit = reuse.latents_for(sample.key, res)
        # A square-only resolution's bucket is its square: latents stored at another bucket of it (the
        # bucket list is not in the image fingerprint) are encoded again, not written into a square stream.
        if hit is not None and _latent_fits(hit[0], buckets.get(res, (res, res)), cfg):
            out.latents[res] = hit
        else:
            wanted.append(res)
    if wanted:
        try:  # JPEGs >= 2x a resolution decode at a reduced scale (encode/process/images.py)
            resized = resize_for_resolutions(
                sample.image or b"", cfg.filter.max_pixels, wanted, cfg.transform.resample, buckets
            )
        except ImageRejected as err:
            end.rejected[err.reason] += 1
            return None
        for res in wanted:
            pixels = resized[res]
            if pixels is None:
                end.smaller_than_resolution[res] += 1
                out.geometry.pop(res, None)
            else:
                out.pixels[res] = pixels
    # Absent at every resolution (counted there): no row anywhere would hold its caption, so the text
    # tower must not run on it, on this run or (nothing reusable being stored) on any rerun.
    return out if out.pixels or out.latents else None


def _latent_fits(latent: np.ndarray, bucket: Bucket, cfg: EncodeConfig) -> bool:
    """A reused latent fits when it was stored at this image's bucket (the crop is then the same: same
    source bytes, same bucket). Reuse is by key, so a changed bucket list re-encodes only moved images."""
    factor = get_preset(cfg.preset).vae_downsample
    return tuple(latent.shape[-2:]) == (bucket[0] // factor, bucket[1] // factor)


def contract_shapes(cfg: EncodeConfig) -> Callable[[int, Bucket | None], contract.Shapes]:
    """The contract's row shapes at any resolution (and bucket of it) for this config's preset (what reused
    rows must have)."""
    preset = get_preset(cfg.preset)

    def shapes(res: int, bucket: Bucket | None = None) -> contract.Shapes:
        square = contract.Shapes(preset.latent_shape(res), preset.text_shape(), cfg.text.store)
        return square if bucket is None else square.for_bucket(bucket, preset.vae_downsample)

    return shapes


def prepare_partition(plan: PartitionPlan, cfg: EncodeConfig) -> Iterator[PreparedSample | PartitionEnd]:
    """Every kept sample of one partition, then its counts. Never raises."""
    end = PartitionEnd(plan.partition.id)
    start = time.perf_counter()
    reuse = ReuseTable()
    try:
        reuse = load_reuse_table(plan.reuse, contract_shapes(cfg))
        for item in read_partition(plan.partition, cfg.source):
            if isinstance(item, Rejected):
                end.samples_read += item.count
                end.rejected[item.reason] += item.count
                continue
            end.samples_read += 1
            chosen = select_sample(item, cfg)
            if isinstance(chosen, str):
                end.rejected[chosen] += 1
                continue
            prepared = prepare_sample(item, chosen, plan, reuse, cfg, end)
            if prepared is not None:
                end.admitted_unchecked.update(chosen.unchecked)
                yield prepared
    except SourceError as err:  # the config does not fit the input: no rerun fixes it
        end.error, end.config_error = str(err), True
    except Exception as err:  # not a per-sample problem: retry the whole partition on the next run
        end.error = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"
    finally:
        reuse.close()
    end.seconds = time.perf_counter() - start
    yield end


@dataclass
class PreparedBatch:
    """Up to `encoder.batch_size` kept samples of one partition, in input order: what the models run on."""

    partition: str
    samples: list[PreparedSample]


def batch_partition(
    items: Iterable[PreparedSample | PartitionEnd], size: int
) -> Iterator[PreparedBatch | PartitionEnd]:
    """One partition's kept samples in batches of `size` (the last may be short), then its end.

    Batches are formed in the worker, not in the main process: from W workers the main process receives
    their samples in turn, so per-partition batches built there all fill at once, every W x size samples,
    and the device idles while the next round arrives. A failed partition's short last batch is dropped:
    its output is discarded anyway.
    """
    pending: list[PreparedSample] = []
    for item in items:
        if isinstance(item, PartitionEnd):
            if pending and item.error is None:
                yield PreparedBatch(item.partition, pending)
            pending = []
            yield item
            continue
        pending.append(item)
        if len(pending) == size:
            yield PreparedBatch(item.partition, pending)
            pending = []


class PreparedStream(torch.utils.data.IterableDataset):
    """Partitions spread over DataLoader workers; each worker walks its partitions in order and hands over
    whole batches of one partition.

    Batches never span partitions, so the output does not depend on the worker count.
    """

    def __init__(self, plans: Sequence[PartitionPlan], cfg: EncodeConfig):
        self.plans = list(plans)
        self.cfg = cfg

    def __iter__(self) -> Iterator[PreparedBatch | PartitionEnd]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for plan in self.plans[worker::workers]:
            yield from batch_partition(prepare_partition(plan, self.cfg), self.cfg.encoder.batch_size)


def keep_as_is(item: PreparedBatch | PartitionEnd) -> PreparedBatch | PartitionEnd:
    """DataLoader `collate_fn` for batch_size=None: items cross the process boundary untouched."""
    return item
