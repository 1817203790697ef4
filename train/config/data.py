"""The `data` section: one encoded dataset (`uri`) or a mix of several (`streams`, Streaming's weights)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from shared.config import ConfigError
from shared.config.values import allowed
from train.config.checks import BatchingMethod

# The sizes Streaming reads (streaming.base.util.bytes_to_int, lower-cased): whole bytes with or without "b",
# or a number with kb ... pb (powers of 1024). Checked here, before any work: the launcher loads this config
# without importing Streaming (~6 s), and a size Streaming could not read failed every rank with a traceback.
_SIZE = re.compile(r"(\d+(\.\d*)?\s*[kmgtp]b|\d+b?)")


def check_cache_limit(value: str | None) -> None:
    """data.cache_limit is a size above zero that Streaming reads, or None."""
    if value is None:
        return
    text = str(value).strip().lower()
    if _SIZE.fullmatch(text) and any(digit in text for digit in "123456789"):  # above zero
        return
    raise ConfigError(
        f"data.cache_limit={value} is not a size above zero: give bytes or a number with kb, mb, gb, tb, pb "
        "(e.g. data.cache_limit=500gb), or null to keep every downloaded shard"
    )


@dataclass
class StreamConfig:
    """One encoded dataset in a mix (data.streams); docs/dataset-mixing.md."""

    # The encode output root of this dataset: a local folder or s3://bucket/prefix.
    uri: str = ""
    # Its name in logs, metrics (data/samples/<name>) and checkpoints; "": the uri's last path part.
    name: str = ""
    # Dataset version id to pin; None: the current one at the first start.
    version: str | None = None
    # At most one of the three weights (Streaming's semantics). proportion: relative share of each epoch
    # (the shares are normalised over the mix); repeat: this many passes over the stream per epoch (2.0:
    # each sample twice, 0.5: half of them); choose: exactly this many of its samples per epoch. A mix uses
    # relative weights (proportion) or absolute ones (repeat / choose), never both; no weight: its size.
    proportion: float | None = allowed(None, gt=0)
    repeat: float | None = allowed(None, gt=0)
    choose: int | None = allowed(None, ge=1)

    def __post_init__(self) -> None:
        name, weights = self.resolved_name() or "#?", [w for w in self._weights() if w[1] is not None]
        if not self.uri:
            raise ConfigError(f"data.streams: stream {name} has no uri; give each stream uri=<encode output>")
        if len(weights) > 1:
            raise ConfigError(
                f"data.streams: stream {name} sets {' and '.join(k for k, _ in weights)}; give one"
            )

    def _weights(self) -> list[tuple[str, float | int | None]]:
        return [("proportion", self.proportion), ("repeat", self.repeat), ("choose", self.choose)]

    def resolved_name(self) -> str:
        return self.name or self.uri.rstrip("/").rsplit("/", 1)[-1]

    def weight(self) -> tuple[str, float | int] | None:
        """("proportion" | "repeat" | "choose", value), or None when no weight is set."""
        return next(((k, v) for k, v in self._weights() if v is not None), None)


def check_streams(streams: list[StreamConfig], epoch_size: int | None) -> None:
    """The mix rules Streaming would enforce mid-construction, checked before any work, naming streams."""
    names = [s.resolved_name() for s in streams]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"data.streams: the name(s) {dupes} are used twice; give each stream its own name=")
    relative = [n for s, n in zip(streams, names, strict=True) if s.proportion is not None]
    absolute = [
        n for s, n in zip(streams, names, strict=True) if s.repeat is not None or s.choose is not None
    ]
    if relative and absolute:
        raise ConfigError(
            f"data.streams mixes relative weights (proportion: {', '.join(relative)}) with absolute ones "
            f"(repeat/choose: {', '.join(absolute)}), which Streaming refuses; weight every stream by "
            "proportion, or every stream by repeat/choose"
        )
    if relative and len(relative) != len(streams):
        unset = [n for n in names if n not in relative]
        raise ConfigError(f"data.streams: give {', '.join(unset)} a proportion too (all or none of a mix)")
    if epoch_size is not None and absolute:
        raise ConfigError(
            "data.epoch_size sets the epoch of a proportion mix; with repeat/choose the epoch is their sum "
            f"(streams {', '.join(absolute)}): drop data.epoch_size"
        )


@dataclass
class DataConfig:
    # The encode output root (the dataset config's output.uri): a local folder or s3://bucket/prefix.
    # The one-dataset shorthand; for a mix use `streams` instead (not both).
    uri: str = ""
    # Several encoded datasets mixed by Streaming (StreamConfig; docs/dataset-mixing.md). []: just `uri`.
    streams: list[StreamConfig] = field(default_factory=list)
    # How a mix fills each batch (Streaming's batching_method): random (samples drawn across streams),
    # stratified (every batch holds each stream's share), per_stream (each batch from one stream),
    # device_per_stream (each device batch from one stream).
    batching_method: BatchingMethod = "random"
    # Samples per epoch of a proportion mix (Streaming's epoch_size); None: the streams' total size.
    epoch_size: int | None = allowed(None, ge=1)
    # Which of the dataset's resolutions this phase trains on (256 for SD2 phase 1, 512 for phase 2).
    resolution: int = allowed(256, ge=1)
    # Dataset version id to pin (versions/<vid>/ in the encode output); None: the current one at start.
    version: str | None = None
    # Local cache root for downloaded shards; each (dataset root, version, resolution) gets its own folder
    # below it, because two live StreamingDatasets must not share one. "": <tmp>/sd-pretrain-streaming-<uid>,
    # private to this user (a planted folder there is refused, not used).
    cache_dir: str = ""
    # Resuming against a dataset with another fingerprint is refused unless this is true.
    allow_dataset_change: bool = False
    shuffle: bool = True
    shuffle_algo: Literal["py1e", "py1br", "py1b", "py1s", "py2s", "naive"] = "py1e"
    shuffle_seed: int | None = allowed(None, ge=0, lt=2**32)  # None: the run's `seed`
    shuffle_block_size: int | None = allowed(None, ge=1)  # None: Streaming's default for shuffle_algo
    # Fixes the sample order independently of the GPU count, so a run resumed on a different number of
    # nodes sees the same order. None: the number of physical nodes at the first start.
    num_canonical_nodes: int | None = allowed(None, ge=1)
    predownload: int | None = None  # samples to download ahead per worker; None: Streaming's default
    # e.g. "500gb": a node evicts its coldest shards above this (shared by the node's ranks); None: keep all.
    # Size it for what a node reads at once (docs/cluster.md); Streaming refuses less than 4 shards.
    cache_limit: str | None = None
    download_timeout: float = allowed(120.0, gt=0)  # seconds per shard
    num_workers: int = 8  # dataloader worker processes per rank
    prefetch_factor: int = allowed(2, ge=1)  # batches each worker loads ahead (only with num_workers > 0)

    def __post_init__(self) -> None:
        if self.uri and self.streams:
            raise ConfigError(
                "data.uri and data.streams are both set: data.uri is the one-dataset shorthand; move it into "
                "data.streams (or pass data.uri= to clear it)"
            )
        if self.streams and self.version is not None:
            raise ConfigError(
                f"data.version={self.version} is the one-dataset shorthand's pin; a mix pins each dataset "
                "with its own data.streams[i].version: move it there (or pass data.version=null)"
            )
        if self.streams:
            check_streams(self.streams, self.epoch_size)
        check_cache_limit(self.cache_limit)

    def is_mix(self) -> bool:
        return bool(self.streams)
