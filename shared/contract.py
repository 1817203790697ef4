"""The data contract between encode and train, declared once.

encode writes MDS rows through `mds_columns`/`make_row`; train reads them and checks the dataset manifest
against its model with `check_compatible` before step 1. Latents are stored *unscaled* as the VAE's
diagonal Gaussian (mean, logvar); the VAE scale factor lives in the manifest and train applies it exactly
once, after drawing a fresh sample each time it reads the row. Caption dropout is never baked in: the
empty-caption embedding is stored once in the manifest and swapped in at train time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shared import storage
from shared.encoders import EMBEDDINGS, TOKENS

# Bump when the meaning or layout of a column changes; train refuses datasets with another version.
CONTRACT_VERSION = 1

KEY = "key"  # str: the source sample key (img2dataset key, or path relative to the image folder)
CAPTION = "caption"  # str: the caption as read from the source, before cleaning (so text can be redone)
LATENT_MEAN = "latent_mean"  # float16 [C, H/f, W/f]: VAE posterior mean, unscaled
LATENT_LOGVAR = "latent_logvar"  # float16 [C, H/f, W/f]: VAE posterior log-variance
TEXT_EMBEDDING = "text_embedding"  # float16 [L, D]: penultimate text layer + final LayerNorm
# text.store=tokens stores this instead of TEXT_EMBEDDING: the tokenizer's ids, uint16 [L]; train runs the
# frozen text tower the manifest names on them. 154 B instead of 157,696 B per sample at SD2 shapes.
TEXT_TOKENS = "text_tokens"
# Bucketed resolutions (encode transform.buckets) also store where each latent came from, as SDXL-style
# micro-conditioning needs it: the displayed image size and the crop box taken from it.
ORIGINAL_SIZE = "original_size"  # int32 [2]: (height, width) of the upright source image, in px
CROP_BOX = "crop_box"  # float32 [4]: (left, top, right, bottom) of the cropped region, in source px
GEOMETRY_COLUMNS = {ORIGINAL_SIZE: "ndarray:int32:2", CROP_BOX: "ndarray:float32:4"}
# The columns train decodes (a dataset holds one of the two text columns); key and caption are never read.
TRAIN_COLUMNS = (LATENT_MEAN, LATENT_LOGVAR, TEXT_EMBEDDING, TEXT_TOKENS)

LATENT_DTYPE = "float16"
TEXT_DTYPE = "float16"
TOKEN_DTYPE = "uint16"
# Token ids must fit uint16: OpenCLIP's / SD2's vocabulary has 49,408 entries.
TOKEN_ID_LIMIT = 1 << 16
# diffusers clamps the VAE logvar to this range before exp(); stored values are clamped the same way.
LOGVAR_RANGE = (-30.0, 20.0)


@dataclass(frozen=True)
class Shapes:
    """What fixes a resolution's row layout."""

    latent: tuple[int, int, int]
    text: tuple[int, int]  # the embedding the U-Net conditions on, [L, D], whichever way it is stored
    store: str = EMBEDDINGS  # text.store: the TEXT_EMBEDDING column, or TEXT_TOKENS [L] (shared/encoders.py)
    bucketed: bool = False  # rows also hold GEOMETRY_COLUMNS (a bucketed resolution's streams)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Shapes:
        # Manifests written before text.store existed hold embeddings.
        latent, text = tuple(obj["latent"]), tuple(obj["text"])
        return cls(latent, text, obj.get("store", EMBEDDINGS), bool(obj.get("bucketed", False)))  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"latent": list(self.latent), "text": list(self.text)}
        if self.store != EMBEDDINGS:  # embeddings manifests keep the JSON they always had
            out["store"] = self.store
        if self.bucketed:  # square-only manifests too
            out["bucketed"] = True
        return out

    def for_bucket(self, bucket: tuple[int, int], downsample: int) -> Shapes:
        """The row shapes of one bucket (pixel (H, W)) of this resolution: its latent is [C, H/f, W/f]."""
        latent = (self.latent[0], bucket[0] // downsample, bucket[1] // downsample)
        return replace(self, latent=latent, bucketed=True)

    @property
    def text_column(self) -> str:
        return TEXT_TOKENS if self.store == TOKENS else TEXT_EMBEDDING

    def text_encoding(self) -> str:
        """The MDS encoding of the stored text column."""
        if self.store == TOKENS:
            return _nd(TOKEN_DTYPE, (self.text[0],))
        return _nd(TEXT_DTYPE, self.text)

    def text_bytes(self) -> int:
        """Bytes of the stored text of one row: L x 2 (tokens) or L x D x 2 (embeddings)."""
        if self.store == TOKENS:
            return np.dtype(TOKEN_DTYPE).itemsize * int(self.text[0])
        return np.dtype(TEXT_DTYPE).itemsize * int(np.prod(self.text))


def _nd(dtype: str, shape: tuple[int, ...]) -> str:
    return f"ndarray:{dtype}:{','.join(str(s) for s in shape)}"


def mds_columns(shapes: Shapes) -> dict[str, str]:
    """MDSWriter column encodings: fixed dtype and shape, so a wrong row fails at write time."""
    return {
        KEY: "str",
        CAPTION: "str",
        LATENT_MEAN: _nd(LATENT_DTYPE, shapes.latent),
        LATENT_LOGVAR: _nd(LATENT_DTYPE, shapes.latent),
        shapes.text_column: shapes.text_encoding(),
        **(GEOMETRY_COLUMNS if shapes.bucketed else {}),
    }


def make_row(
    key: str,
    caption: str,
    latent_mean: np.ndarray,
    latent_logvar: np.ndarray,
    text_embedding: np.ndarray,
    geometry: tuple[tuple[int, int], tuple[float, float, float, float]] | None = None,
) -> dict[str, Any]:
    """One MDS row, cast to the contract's dtypes (the writer then checks the shapes).

    `text_embedding` is the embedding [L, D] (floats), or token ids [L] (integers, text.store=tokens).
    `geometry`: ((height, width), crop box) of a bucketed row (GEOMETRY_COLUMNS); None for square-only.
    """
    row = {
        KEY: key,
        CAPTION: caption,
        LATENT_MEAN: np.ascontiguousarray(latent_mean, dtype=LATENT_DTYPE),
        LATENT_LOGVAR: np.ascontiguousarray(np.clip(latent_logvar, *LOGVAR_RANGE), dtype=LATENT_DTYPE),
        **text_cell(text_embedding),
    }
    if geometry is not None:
        row[ORIGINAL_SIZE] = np.asarray(geometry[0], dtype=np.int32)
        row[CROP_BOX] = np.asarray(geometry[1], dtype=np.float32)
    return row


def text_cell(text: np.ndarray) -> dict[str, np.ndarray]:
    """{column: value} of a row's text: integer arrays are token ids (checked to fit uint16)."""
    text = np.asarray(text)
    if text.dtype.kind not in "iu":
        return {TEXT_EMBEDDING: np.ascontiguousarray(text, dtype=TEXT_DTYPE)}
    if text.size and (int(text.min()) < 0 or int(text.max()) >= TOKEN_ID_LIMIT):
        raise ValueError(
            f"token ids span [{int(text.min())}, {int(text.max())}], outside uint16; a tokenizer with more "
            f"than {TOKEN_ID_LIMIT} entries needs text.store=embeddings"
        )
    return {TEXT_TOKENS: np.ascontiguousarray(text, dtype=TOKEN_DTYPE)}


def stored_text(row: dict[str, Any]) -> np.ndarray:
    """The stored text value of a row, whichever of the two text columns it has."""
    return row[TEXT_TOKENS] if TEXT_TOKENS in row else row[TEXT_EMBEDDING]


def bytes_per_row(shapes: Shapes) -> int:
    """Bytes of the fixed-size columns of one row (captions and keys excluded)."""
    item = np.dtype(LATENT_DTYPE).itemsize
    return 2 * item * int(np.prod(shapes.latent)) + shapes.text_bytes()


class ContractError(ValueError):
    """The dataset and the model disagree; the message names both values and the fix."""


@dataclass(frozen=True)
class Expectation:
    """What a train config needs from a dataset at one resolution."""

    resolution: int
    latent: tuple[int, int, int]
    text: tuple[int, int]
    scale_factor: float | None = None  # None: take the dataset's
    # Latent sides must be multiples of this (the U-Net's 2x downsamplings: 8 for SD2's four levels); the
    # square latent of a resolution is checked as `latent`, every bucket of a bucketed one by this.
    latent_multiple: int = 1


def check_compatible(manifest: Any, want: Expectation) -> None:
    """Refuse to train on a dataset that does not fit the model, naming both values and the fix."""
    if manifest.contract_version != CONTRACT_VERSION:
        raise ContractError(
            f"dataset contract version {manifest.contract_version} != this code's {CONTRACT_VERSION}; "
            "re-run `make encode` with this version of the code"
        )
    res = want.resolution
    if res not in manifest.resolutions:
        have = ", ".join(str(r) for r in sorted(manifest.resolutions)) or "none"
        raise ContractError(
            f"dataset has no {res} px data (it has: {have}); set data.resolution to one of those or add "
            f"{res} to the dataset config's transform.resolutions and re-run `make encode`"
        )
    shapes = manifest.resolutions[res].shapes
    if tuple(shapes.latent) != tuple(want.latent):
        raise ContractError(
            f"dataset latents at {res} px are {list(shapes.latent)} but the model expects "
            f"{list(want.latent)}; the U-Net's in_channels / sample size must match the VAE used by encode "
            "(check `preset`)"
        )
    if tuple(shapes.text) != tuple(want.text):
        raise ContractError(
            f"dataset text embeddings are {list(shapes.text)} but the U-Net cross-attention expects "
            f"{list(want.text)}; encode and train must use the same preset's text encoder"
        )
    check_buckets(manifest.resolutions[res], want)
    check_manifest_values(manifest, tuple(shapes.text))
    if want.scale_factor is not None and abs(manifest.scale_factor - want.scale_factor) > 1e-6:
        raise ContractError(
            f"dataset VAE scale factor is {manifest.scale_factor} but the train config says "
            f"{want.scale_factor}; remove model.scale_factor from the train config to use the dataset's"
        )


def check_buckets(info: Any, want: Expectation) -> None:
    """Every bucket of a bucketed resolution holds latents the U-Net can take: the model's channels, sides
    that are multiples of its downsampling (the square's shape was checked as `want.latent`)."""
    if not getattr(info, "buckets", None):
        return
    for name, shapes in info.bucket_shapes(want.resolution).items():
        channels, height, width = shapes.latent
        if channels != want.latent[0] or height % want.latent_multiple or width % want.latent_multiple:
            raise ContractError(
                f"dataset bucket {name} at {want.resolution} px has latents {list(shapes.latent)}, but the "
                f"model takes {want.latent[0]} channels with sides that are multiples of "
                f"{want.latent_multiple}; re-encode with buckets whose sides are multiples of "
                f"{want.latent_multiple * (want.resolution // want.latent[1])} px (transform.bucket_step)"
            )


# The dtype each ndarray column must have, for readers that do not know the shapes.
_ARRAY_DTYPES = {
    LATENT_MEAN: LATENT_DTYPE,
    LATENT_LOGVAR: LATENT_DTYPE,
    TEXT_EMBEDDING: TEXT_DTYPE,
    TEXT_TOKENS: TOKEN_DTYPE,
    ORIGINAL_SIZE: "int32",
    CROP_BOX: "float32",
}


def undeclared_columns(names: list[str], encodings: list[str], shapes: Shapes | None = None) -> list[str]:
    """Columns of a stored MDS shard that this contract does not declare, as `name:encoding`.

    Readers check a shard's columns with this before reading any row: an undeclared encoding such as
    `pkl` would run code when a row is decoded. With `shapes`, ndarray encodings must match exactly;
    without, their dtype must still be the contract's. Either text column (embeddings or tokens) is
    declared, exactly one must be present: encode reuses latents across a text.store switch.
    """
    if len(names) != len(encodings):
        return [f"<{len(names)} column names for {len(encodings)} encodings>"]
    declared = {KEY: "str", CAPTION: "str"}
    if shapes is not None:
        for store in (EMBEDDINGS, TOKENS):
            declared |= mds_columns(replace(shapes, store=store))
    bad = []
    for name, enc in zip(names, encodings, strict=True):
        if name in declared:
            ok = enc == declared[name]
        else:
            ok = name in _ARRAY_DTYPES and enc.startswith(f"ndarray:{_ARRAY_DTYPES[name]}:")
        if not ok:
            bad.append(f"{name}:{enc}")
    missing = sorted({KEY, CAPTION, LATENT_MEAN, LATENT_LOGVAR} - set(names))
    texts = [name for name in (TEXT_EMBEDDING, TEXT_TOKENS) if name in names]
    if len(texts) != 1:
        missing.append(f"{TEXT_EMBEDDING} or {TEXT_TOKENS} (one of them)")
    return bad + [f"{name}:<missing>" for name in missing]


# ------------------------------------------------------------------------- stored data vs the manifest
# Shard files carry this hash in their index (MDSWriter `hashes=`); train verifies it on first read.
# xxh3_64 hashes at several GB/s, so verifying costs far less than downloading the shard.
SHARD_HASH = "xxh3_64"
# Plausible VAE latent scale factors: SD 0.18215, SDXL 0.13025, FLUX 0.3611, SD3 1.5305, tiny 0.62378.
SCALE_FACTOR_RANGE = (1e-3, 10.0)
_REENCODE = (
    "the dataset was damaged or edited after `make encode`; re-run `make encode` into a fresh output.uri"
)


def check_manifest_values(manifest: Any, text_shape: tuple[int, int]) -> None:
    """Refuse manifest values that would train on garbage: a NaN, zero or absurd scale factor; an
    empty-caption embedding that is not exactly one [L, D] text embedding, or not finite."""
    scale = manifest.scale_factor
    lo, hi = SCALE_FACTOR_RANGE
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ContractError(f"dataset manifest scale_factor is {scale!r}, not a finite number; {_REENCODE}")
    if not lo <= scale <= hi:
        raise ContractError(
            f"dataset manifest scale_factor is {scale!r}, outside the plausible range [{lo}, {hi}] "
            f"(SD2's VAE: 0.18215); {_REENCODE}"
        )
    empty = np.asarray(manifest.empty_caption_embedding)
    if tuple(empty.shape) != tuple(text_shape):
        raise ContractError(
            f"dataset manifest empty_caption_embedding has shape {list(empty.shape)} but text embeddings "
            f"are {list(text_shape)}; {_REENCODE}"
        )
    if empty.dtype.kind != "f" or not np.isfinite(empty).all():
        raise ContractError(
            f"dataset manifest empty_caption_embedding ({empty.dtype}) holds non-finite values; {_REENCODE}"
        )
    if getattr(manifest, "text_store", EMBEDDINGS) == TOKENS:
        check_empty_caption_tokens(manifest.empty_caption_tokens, int(text_shape[0]))


def check_empty_caption_tokens(tokens: Any, length: int) -> None:
    """A text.store=tokens manifest must hold the empty caption's ids: [L] integers that fit uint16."""
    ids = None if tokens is None else np.asarray(tokens)
    if ids is None or ids.shape != (length,) or ids.dtype.kind not in "iu":
        got = "nothing" if ids is None else f"{ids.dtype} {list(ids.shape)}"
        raise ContractError(
            f"dataset manifest empty_caption_tokens is {got}, not {length} token ids (text.store=tokens "
            f"needs them for caption dropout); {_REENCODE}"
        )
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= TOKEN_ID_LIMIT):
        raise ContractError(f"dataset manifest empty_caption_tokens are outside uint16; {_REENCODE}")


def mds_column_sizes(shapes: Shapes) -> dict[str, int | None]:
    """Bytes per value of each column as an MDS index records them (None: variable-size)."""
    sizes: dict[str, int | None] = {KEY: None, CAPTION: None}
    latent = np.dtype(LATENT_DTYPE).itemsize * int(np.prod(shapes.latent))
    sizes |= {LATENT_MEAN: latent, LATENT_LOGVAR: latent}
    sizes[shapes.text_column] = shapes.text_bytes()
    if shapes.bucketed:
        sizes |= {ORIGINAL_SIZE: 2 * 4, CROP_BOX: 4 * 4}
    return sizes


@dataclass(frozen=True)
class IndexSummary:
    """What a checked MDS index holds."""

    num_samples: int
    num_shards: int
    hashed: bool  # every shard file records SHARD_HASH


def check_index(index: Any, shapes: Shapes, num_samples: int, where: str) -> IndexSummary:
    """Refuse an MDS index (parsed index.json) that disagrees with the manifest, before anything reads it.

    Checks every shard's columns, encodings and value sizes against `shapes`, that its file names stay
    inside the stream folder, and that the shards' sample counts add up to the manifest's `num_samples`.
    """
    shards = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(shards, list):
        raise ContractError(f"{where} is not an MDS index (no 'shards' list); {_REENCODE}")
    total, hashed = 0, True
    for i, shard in enumerate(shards):
        problem = _shard_problem(shard, shapes)
        if problem:
            raise ContractError(f"{where}: shard {i} {problem}; {_REENCODE}")
        total += shard["samples"]
        hashed = hashed and SHARD_HASH in (shard["raw_data"].get("hashes") or {})
    if total != num_samples:
        raise ContractError(
            f"{where} lists {total} samples but the dataset manifest says {num_samples}; {_REENCODE}"
        )
    return IndexSummary(total, len(shards), hashed and bool(shards))


def _shard_problem(shard: Any, shapes: Shapes) -> str | None:
    """What is wrong with one shard entry of an index (None: nothing)."""
    if not isinstance(shard, dict) or shard.get("format") != "mds":
        return "is not an MDS shard entry"
    names, encodings = shard.get("column_names"), shard.get("column_encodings")
    if not isinstance(names, list) or not isinstance(encodings, list) or len(names) != len(encodings):
        return "has no matching column_names / column_encodings lists"
    if dict(zip(names, encodings, strict=True)) != mds_columns(shapes) or len(names) != len(set(names)):
        have = dict(zip(names, encodings, strict=True))
        return f"has columns {have} but the manifest's shapes give {mds_columns(shapes)}"
    sizes = shard.get("column_sizes")
    if not isinstance(sizes, list) or dict(zip(names, sizes, strict=False)) != mds_column_sizes(shapes):
        return f"has column_sizes {sizes} but the manifest's shapes give {mds_column_sizes(shapes)}"
    samples = shard.get("samples")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        return f"has a sample count of {samples!r}"
    for key in ("raw_data", "zip_data"):
        info = shard.get(key)
        if info is None and key == "zip_data":
            continue
        if not isinstance(info, dict):
            return f"has no {key} entry"
        reason = storage.unsafe_name_reason(info.get("basename"))
        if reason:
            return f"{key}.basename {info.get('basename')!r} {reason} (it must stay inside the folder)"
    return None
