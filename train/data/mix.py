"""Several encoded datasets in one run (`data.streams`): each pinned, checked and leased as one dataset is,
then mixed by Streaming's `Stream` weights (proportion / repeat / choose) in one StreamingDataset.

What this adds to Streaming (docs/dataset-mixing.md):
- every stream is read through its own manifest and pinned version (train/data/loader.py `pin_version`), so
  each keeps its fingerprint, version and lease; the mix itself is fingerprinted (`mix_record`) and kept in
  every checkpoint, because Streaming's resume state holds only (epoch, sample in epoch) and would silently
  continue a changed mix at the same sample count.
- the samples each stream gives per epoch are computed here without Streaming (`epoch_counts`, the same
  arithmetic as `streaming.Stream.apply_weights`), so the launch planner counts them before any job runs.
- the streams must share one encoder identity: the model takes its empty-caption embedding, scale factor and
  text encoder from one manifest.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.contract import ContractError
from shared.encoders import EncoderIdentity
from shared.manifest import DatasetManifest, fingerprint, read_manifest
from train.config import DataConfig, StreamConfig

if TYPE_CHECKING:  # the loader imports torch; the launch planner imports this module without it
    from train.data.loader import PinnedData

log = logging.getLogger(__name__)

_MB = 1e6


@dataclass(frozen=True)
class PinnedStream:
    """One stream of a mix: its config (name and weight) and its pinned dataset version."""

    name: str
    cfg: StreamConfig
    pinned: PinnedData

    def record(self) -> dict[str, Any]:
        """What a checkpoint remembers about this stream (the one-dataset record plus name and weight)."""
        weight = self.cfg.weight()
        return {"name": self.name, **self.pinned.record(), "weight": list(weight) if weight else None}


# ---------------------------------------------------------------------------------------- manifests
def stream_data_config(cfg: DataConfig, stream: StreamConfig) -> DataConfig:
    """The one-dataset DataConfig of a stream (same resolution, cache root and loader settings)."""
    return dataclasses.replace(cfg, uri=stream.uri, version=stream.version, streams=[])


def read_stream_manifests(cfg: DataConfig) -> list[tuple[str, DatasetManifest]]:
    """(name, manifest) of every stream, at its pinned or current version."""
    return [(s.resolved_name(), read_manifest(s.uri.rstrip("/"), s.version)) for s in cfg.streams]


def check_same_encoders(manifests: list[tuple[str, DatasetManifest]]) -> None:
    """Refuse a stream whose latents or text came from other encoders than the first stream's: the model
    is built from one manifest (empty-caption embedding, scale factor, text encoder)."""
    first_name, first = manifests[0]
    want = _encoder_facts(first)
    for name, manifest in manifests[1:]:
        have = _encoder_facts(manifest)
        for key in want:
            if have[key] != want[key]:
                raise ContractError(
                    f"data.streams: stream {name} was encoded with {key} {have[key]!r} but stream "
                    f"{first_name} with {want[key]!r}; a mix must share its VAE and text encoder "
                    "(re-encode one of them with the other's encoder config)"
                )


def _encoder_facts(manifest: DatasetManifest) -> dict[str, Any]:
    facts = encoder_facts(manifest.identity, float(manifest.scale_factor))
    return {"scale factor": facts.pop("scale factor"), "text store mode": manifest.text_store, **facts}


def encoder_facts(identity: EncoderIdentity, scale_factor: float) -> dict[str, Any]:
    """What decides the latent and text spaces a model learns: data encoded with other values is data of
    another model."""
    return {
        "scale factor": float(scale_factor),
        "VAE weights": identity.vae_hash,
        "text encoder weights": identity.text_hash,
        "tokenizer": identity.tokenizer_hash,
        "preset": identity.preset,
    }


def pin_streams(
    cfg: DataConfig, manifests: list[tuple[str, DatasetManifest]], run_key: str = ""
) -> list[PinnedStream]:
    """Pin every stream's version into its own cache folder (after the contract checks; `run_key`: as
    train/data/loader.py pin_version's)."""
    from train.data.loader import pin_version

    return [
        PinnedStream(name, stream, pin_version(stream_data_config(cfg, stream), manifest, run_key))
        for stream, (name, manifest) in zip(cfg.streams, manifests, strict=True)
    ]


# --------------------------------------------------------------------------------------------- record
def mix_record(cfg: DataConfig, streams: list[PinnedStream]) -> dict[str, Any]:
    """The checkpoint's `dataset` record for a mix: every stream's record and one fingerprint over what
    decides the sample order (uris, versions, dataset fingerprints, weights, batching method, epoch size)."""
    records = [s.record() for s in streams]
    mix = {
        "streams": [{k: r[k] for k in ("name", "uri", "version", "fingerprint", "weight")} for r in records],
        "batching_method": cfg.batching_method,
        "epoch_size": cfg.epoch_size,
    }
    return {
        "uri": "data.streams: " + ", ".join(f"{r['name']}={r['uri']}" for r in records),
        "version": ", ".join(f"{r['name']}={r['version']}" for r in records),
        "resolution": cfg.resolution,
        "fingerprint": "mix-" + fingerprint(mix)[:16],
        "num_samples": sum(r["num_samples"] for r in records),
        "mix": mix,
        "streams": records,
    }


# ------------------------------------------------------------------------------------- epoch counts
def epoch_counts(
    weights: list[tuple[str, float | int] | None], sizes: list[int], epoch_size: int | None, seed: int
) -> list[int]:
    """Samples each stream gives per epoch: `streaming.Stream.apply_weights` without building Streaming
    (tests check the two agree). `seed` is the shuffle seed (it places the rounding shortfall)."""
    samples = np.array(sizes, np.int64)
    if any(w is not None and w[0] == "proportion" for w in weights) or (epoch_size and not any(weights)):
        total = epoch_size or int(samples.sum())
        share = (
            np.array([w[1] for w in weights], np.float64)  # type: ignore[index]
            if any(weights)
            else samples.astype(np.float64)
        )
        share /= share.sum()
        chosen = (total * share).astype(np.int64)
        shortfall = total - chosen.sum()
        chosen[np.random.default_rng(seed).choice(len(sizes), shortfall, False)] += 1
        return [int(c) for c in chosen]
    out = []
    for weight, size in zip(weights, sizes, strict=True):
        if weight is None:
            out.append(int(size))
        elif weight[0] == "repeat":
            out.append(int(weight[1] * size))
        else:
            out.append(int(weight[1]))
    return out


def streams_to_streaming(streams: list[PinnedStream], download_timeout: float) -> list[Any]:
    """Streaming `Stream`s over the pinned remotes and private cache folders, with their weights."""
    from streaming import Stream

    from shared.contract import SHARD_HASH

    out = []
    for stream in streams:
        weight = stream.cfg.weight()
        p = stream.pinned
        out.append(
            Stream(
                remote=p.remote,
                local=p.local,
                download_timeout=download_timeout,
                validate_hash=SHARD_HASH if p.hashed else None,
                **({weight[0]: weight[1]} if weight else {}),
            )
        )
    return out


# ------------------------------------------------------------------------------------------ planner
def _planned_streams(
    cfg: DataConfig, seed: int
) -> tuple[list[StreamConfig], list[DatasetManifest], list[Any], list[int]]:
    """(streams, their manifests, their resolution infos, samples each gives per epoch) for the planner;
    raises what reading a manifest raises."""
    streams = cfg.streams or [StreamConfig(uri=cfg.uri, version=cfg.version)]
    manifests = [read_manifest(s.uri.rstrip("/"), s.version) for s in streams]
    infos = [m.resolutions[cfg.resolution] for m in manifests]
    counts = epoch_counts([s.weight() for s in streams], [i.num_samples for i in infos], cfg.epoch_size, seed)
    return streams, manifests, infos, counts


def plan_lines(cfg: DataConfig, seed: int) -> list[str]:
    """For `train launch --dry-run`: the epoch size, and per stream its samples, stored bytes and the
    samples and bytes it gives per epoch (read from each manifest; unreadable data says so)."""
    if not cfg.streams and not cfg.uri:
        return ["data: counts unavailable (no data.uri given yet)"]
    try:
        streams, manifests, infos, counts = _planned_streams(cfg, seed)
    except Exception as err:  # best effort, like the text.store line (S3 errors are not all OSError)
        return [f"data: counts unavailable ({type(err).__name__}: {err})"]
    total = sum(counts) or 1
    lines = [
        f"data: {len(streams)} stream(s) at {cfg.resolution} px, epoch {sum(counts)} samples"
        + (f" (batching {cfg.batching_method})" if cfg.streams else "")
    ]
    for stream, manifest, info, count in zip(streams, manifests, infos, counts, strict=True):
        per_sample = info.bytes / max(info.num_samples, 1)
        weight = stream.weight()
        lines.append(
            f"  {stream.resolved_name()} (version {manifest.version}): {info.num_samples} samples, "
            f"{info.bytes / _MB:.1f} MB stored; {count} per epoch ({100 * count / total:.1f}%"
            + (f", {weight[0]} {weight[1]}" if weight else "")
            + f"), {count * per_sample / _MB:.1f} MB read per epoch"
        )
        if info.buckets:
            lines.append(bucket_line(info.buckets, cfg.resolution))
    return lines


def bucket_cost_factor(buckets: dict[str, dict[str, int]], resolution: int) -> float:
    """What a bucketed dataset's average step costs against a square step at `resolution`: U-Net FLOPs scale
    with pixels, so a bucket of H x W px costs H*W / resolution^2, weighted by the bucket's samples."""
    counts = {name: b["num_samples"] for name, b in buckets.items()}
    pixels = sum(n * math.prod(int(v) for v in name.split("x")) for name, n in counts.items())
    return pixels / ((sum(counts.values()) or 1) * resolution * resolution)


def bucket_line(buckets: dict[str, dict[str, int]], resolution: int) -> str:
    """A bucketed dataset's mix for the dry run: each bucket's share and what a step costs against squares."""
    counts = {name: b["num_samples"] for name, b in buckets.items()}
    total = sum(counts.values()) or 1
    shares = ", ".join(f"{name} {n} ({100 * n / total:.1f}%)" for name, n in counts.items())
    factor = bucket_cost_factor(buckets, resolution)
    cost = f"compute x{factor:.3f} of square {resolution} px steps (FLOPs scale with pixels)"
    return f"    buckets: {shares}; {cost}"


def data_cost_factor(cfg: DataConfig, seed: int) -> float:
    """The run's compute per sample against square samples at data.resolution, over its epoch's mix: each
    stream's bucket factor weighted by the samples it gives per epoch (1.0 for square-only data, or when a
    manifest cannot be read: the dry run's data line says why)."""
    if not cfg.streams and not cfg.uri:
        return 1.0
    try:
        _, _, infos, counts = _planned_streams(cfg, seed)
    except Exception:  # best effort, as plan_lines
        return 1.0
    factors = [bucket_cost_factor(i.buckets, cfg.resolution) if i.buckets else 1.0 for i in infos]
    return sum(f * n for f, n in zip(factors, counts, strict=True)) / (sum(counts) or 1)
