"""The dataset manifest and the on-storage layout of an encode output.

    <root>/manifest.json                      the current version (written last: publishing is one PUT)
    <root>/versions/<vid>/manifest.json        every published version, kept until `encode gc`
    <root>/versions/<vid>/<res>/index.json     that version's merged MDS index for one resolution
    <root>/<res>/index.json                    the current version's index (plain StreamingDataset works)
    <root>/<res>/<partition>-<fp>/shard.*.mds  immutable partition outputs, shared between versions
    <root>/versions/<vid>/<res>/<HxW>/index.json   a bucketed resolution (encode transform.buckets): one
    <root>/<res>/<partition>-<fp>/<HxW>/shard.*    index per bucket, shards in a sub-folder per bucket
    <root>/_parts/<partition>/<recipe>.json    done-markers: what produced a partition, and its counts
    <root>/_claims/rank-<R>-of-<W>.json        a live `encode run` rank's claim (encode/plan/claims.py)

Shards live under `<root>/<res>/` so every index (current or older version) names them by a relative path
below its stream root; train places the wanted version's index into its local cache before streaming.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shared import storage
from shared.buckets import parse_bucket
from shared.contract import CONTRACT_VERSION, ContractError, Shapes
from shared.encoders import EncoderIdentity

MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.json"


def fingerprint(obj: Any) -> str:
    """Stable short hash of JSON-able data (sorted keys)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class Layout:
    """Where each piece of an encode output lives under its root URI."""

    root: str

    @property
    def manifest(self) -> str:
        return storage.join(self.root, MANIFEST_NAME)

    @property
    def metrics(self) -> str:
        return storage.join(self.root, "metrics.json")

    def version_dir(self, vid: str) -> str:
        return storage.join(self.root, "versions", vid)

    def version_manifest(self, vid: str) -> str:
        return storage.join(self.version_dir(vid), MANIFEST_NAME)

    def version_index(self, vid: str, resolution: int) -> str:
        return storage.join(self.version_dir(vid), str(resolution), INDEX_NAME)

    def bucket_index(self, vid: str, resolution: int, bucket: str) -> str:
        """A bucketed resolution's per-bucket index of one version (shards named below stream_root)."""
        return storage.join(self.version_dir(vid), str(resolution), bucket, INDEX_NAME)

    def stream_root(self, resolution: int) -> str:
        """The `remote` a StreamingDataset uses for one resolution."""
        return storage.join(self.root, str(resolution))

    def current_index(self, resolution: int) -> str:
        return storage.join(self.stream_root(resolution), INDEX_NAME)

    def partition_output(self, resolution: int, dirname: str) -> str:
        return storage.join(self.stream_root(resolution), dirname)

    def parts_dir(self) -> str:
        return storage.join(self.root, "_parts")

    def claims_dir(self) -> str:
        return storage.join(self.root, "_claims")

    def done_marker(self, partition: str, recipe: str) -> str:
        return storage.join(self.parts_dir(), partition, f"{recipe}.json")


def encode_array(array: np.ndarray) -> dict[str, Any]:
    return {
        "dtype": str(array.dtype),
        "shape": list(array.shape),
        "base64": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode(),
    }


def decode_array(obj: dict[str, Any]) -> np.ndarray:
    raw = base64.b64decode(obj["base64"])
    return np.frombuffer(raw, dtype=obj["dtype"]).reshape(obj["shape"]).copy()


@dataclass
class ResolutionInfo:
    num_samples: int
    shapes: Shapes
    bytes: int  # bytes of this resolution's shard files
    smaller_than_resolution: int  # passed the filters but too small for this resolution (never upscaled)
    fingerprint: str  # of everything that shaped this resolution's rows
    # A bucketed resolution: "HxW" (pixels) -> {"num_samples": n, "bytes": b}, portrait to landscape.
    # None: square-only (every row at `shapes`; such manifests keep the JSON they always had).
    buckets: dict[str, dict[str, int]] | None = None

    def bucket_shapes(self, resolution: int) -> dict[str, Shapes]:
        """ "HxW" -> the row shapes of that bucket of this `resolution` ({} when square-only)."""
        factor = resolution // self.shapes.latent[1]  # the VAE's downsample factor
        return {name: self.shapes.for_bucket(parse_bucket(name), factor) for name in self.buckets or {}}


@dataclass
class DatasetManifest:
    version: str
    created: str
    preset: str
    scale_factor: float
    resolutions: dict[int, ResolutionInfo]
    rejected: dict[str, int]
    samples_read: int
    fingerprints: dict[str, Any]
    empty_caption_embedding: np.ndarray
    partitions: list[dict[str, Any]]
    config: dict[str, Any]
    contract_version: int = CONTRACT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    # The frozen encoders (shared/encoders.py). Manifests written before it: read from the older keys.
    encoder: EncoderIdentity | None = None
    # text.store=tokens: the empty caption's token ids [L] (uint16), what caption dropout swaps in.
    empty_caption_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.encoder is None:
            self.encoder = EncoderIdentity.from_legacy(
                self.preset,
                dict(self.fingerprints.get("encoders") or {}),
                dict(self.config.get("encoder") or {}),
                dict(self.config.get("text") or {}),
            )

    @property
    def identity(self) -> EncoderIdentity:
        """The encoder identity (always set after construction)."""
        assert self.encoder is not None
        return self.encoder

    @property
    def text_store(self) -> str:
        return self.identity.text_store

    @property
    def dataset_fingerprint(self) -> str:
        return str(self.fingerprints["dataset"])

    def num_samples(self, resolution: int) -> int:
        return self.resolutions[resolution].num_samples

    def to_json(self) -> dict[str, Any]:
        from shared.contract import mds_columns

        out = asdict(self)
        out["resolutions"] = {str(r): _resolution_json(info) for r, info in self.resolutions.items()}
        out["num_samples"] = {str(r): info.num_samples for r, info in self.resolutions.items()}
        out["schema"] = {str(r): mds_columns(info.shapes) for r, info in self.resolutions.items()}
        out["empty_caption_embedding"] = encode_array(self.empty_caption_embedding)
        out["encoder"] = self.identity.to_json()
        if self.empty_caption_tokens is None:
            out.pop("empty_caption_tokens")
        else:
            out["empty_caption_tokens"] = encode_array(self.empty_caption_tokens)
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> DatasetManifest:
        obj = dict(obj)
        obj.pop("num_samples", None)
        obj.pop("schema", None)
        obj["resolutions"] = {
            int(r): ResolutionInfo(**{**info, "shapes": Shapes.from_json(info["shapes"])})
            for r, info in obj["resolutions"].items()
        }
        obj["empty_caption_embedding"] = decode_array(obj["empty_caption_embedding"])
        if isinstance(obj.get("encoder"), dict):
            obj["encoder"] = EncoderIdentity.from_json(obj["encoder"])
        if obj.get("empty_caption_tokens") is not None:
            obj["empty_caption_tokens"] = decode_array(obj["empty_caption_tokens"])
        return cls(**obj)


def _resolution_json(info: ResolutionInfo) -> dict[str, Any]:
    out = {**asdict(info), "shapes": info.shapes.to_json()}
    if info.buckets is None:
        out.pop("buckets")
    return out


def read_manifest(root: str, version: str | None = None) -> DatasetManifest:
    """The current manifest of an encode output, or a given older version's."""
    layout = Layout(root)
    uri = layout.version_manifest(version) if version else layout.manifest
    try:
        raw = storage.read_json(uri)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no dataset manifest at {uri}: point to the output.uri of a finished `make encode` run (or run "
            "`python -m encode finalize` if its ranks finished but never merged)"
        ) from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise ContractError(
            f"{uri} is not a readable manifest ({err}): it was cut short or edited; restore it (the root "
            "manifest.json is a copy of the current version's versions/<version>/manifest.json)"
        ) from None
    return DatasetManifest.from_json(raw)
