"""Real img2dataset layouts of the synthetic samples: webdataset tars, parquet shards, a caption folder."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from encode.sample_data.render import (
    FAILED_DOWNLOAD_EVERY,
    FOLDER_JSON_EVERY,
    FOLDER_PNG_EVERY,
    FOLDER_SUBDIR_EVERY,
    KEYS_PER_SHARD,
    LOW_SIMILARITY_FRACTION,
    NSFW_FRACTION,
    PARQUET_ROW_GROUP,
    TAR_MTIME,
    UNSAFE_FRACTION,
    UNSURE_FRACTION,
    URL_BASE,
    WATERMARK_FRACTION,
    SampleSpec,
    encode_image,
    jpeg,
    pick_spec,
    render,
)


# ------------------------------------------------------------------------------------------ metadata
def _laion_scores(rng: np.random.Generator) -> dict[str, float]:
    """punsafe / pwatermark / similarity like LAION-2B's, a few beyond the default thresholds."""
    unsafe = rng.random() < UNSAFE_FRACTION
    watermark = rng.random() < WATERMARK_FRACTION
    low_sim = rng.random() < LOW_SIMILARITY_FRACTION
    return {
        "punsafe": round(float(rng.uniform(0.2, 0.95) if unsafe else rng.uniform(0.0, 0.08)), 4),
        "pwatermark": round(float(rng.uniform(0.6, 0.98) if watermark else rng.uniform(0.0, 0.4)), 4),
        "similarity": round(float(rng.uniform(0.12, 0.2) if low_sim else rng.uniform(0.26, 0.4)), 4),
    }


def _nsfw_tag(rng: np.random.Generator) -> str:
    """A LAION-400M style `NSFW` column value."""
    roll = rng.random()
    return (
        "NSFW" if roll < NSFW_FRACTION else "UNSURE" if roll < NSFW_FRACTION + UNSURE_FRACTION else "UNLIKELY"
    )


def _success_meta(key: str, spec: SampleSpec, data: bytes, rng: np.random.Generator) -> dict[str, Any]:
    return {
        "key": key,
        "caption": spec.caption,
        "url": f"{URL_BASE}/{key}.jpg",
        "width": spec.width,
        "height": spec.height,
        "original_width": spec.width,
        "original_height": spec.height,
        "status": "success",
        "error_message": None,
        "exif": None,
        "sha256": hashlib.sha256(data).hexdigest(),
        **_laion_scores(rng),
    }


def _failed_meta(key: str, spec: SampleSpec) -> dict[str, Any]:
    return {
        "key": key,
        "caption": spec.caption,
        "url": f"{URL_BASE}/{key}.jpg",
        "width": None,
        "height": None,
        "original_width": None,
        "original_height": None,
        "status": "failed_to_download",
        "error_message": "HTTP Error 404: Not Found",
        "exif": None,
        "sha256": None,
        "punsafe": None,
        "pwatermark": None,
        "similarity": None,
    }


def _stats(shard: int, metas: list[dict[str, Any]]) -> dict[str, Any]:
    """img2dataset's {shard}_stats.json, with fixed times so the bytes are reproducible."""
    successes = sum(1 for m in metas if m["status"] == "success")
    failed = len(metas) - successes
    status_dict = {"success": successes, **({"HTTP Error 404: Not Found": failed} if failed else {})}
    return {
        "count": len(metas),
        "successes": successes,
        "failed_to_download": failed,
        "failed_to_resize": 0,
        "duration": 0.0,
        "start_time": 0.0,
        "end_time": 0.0,
        "status_dict": status_dict,
        "shard": f"{shard:05d}",
    }


def _key(shard: int, index: int) -> str:
    return f"{shard * KEYS_PER_SHARD + index:09d}"


@dataclass
class _Row:
    """One row of a shard: a rendered image (None: img2dataset failed to download it) and its metadata."""

    meta: dict[str, Any]
    image: bytes | None


def _shard_rows(
    shard: int,
    per_shard: int,
    seed: int,
    nsfw_column: bool = False,
    size: tuple[int, int] | None = None,
) -> list[_Row]:
    """`per_shard` successful samples plus a few failed downloads, interleaved like img2dataset's keys."""
    failures = per_shard // FAILED_DOWNLOAD_EVERY
    total = per_shard + failures
    picker = np.random.default_rng([seed, shard, total])
    failed = {int(i) for i in picker.choice(total, size=failures, replace=False)} if failures else set()
    rows = []
    for index in range(total):
        rng = np.random.default_rng([seed, shard, index])
        key, spec = _key(shard, index), pick_spec(rng, size)
        if index in failed:
            rows.append(_Row(_failed_meta(key, spec), None))
            continue
        data = jpeg(render(spec, rng), rng)
        meta = _success_meta(key, spec, data, rng)
        if nsfw_column:
            meta["NSFW"] = _nsfw_tag(rng)
        rows.append(_Row(meta, data))
    return rows


# --------------------------------------------------------------------------------------------- tars
def _tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), TAR_MTIME, 0o644
    tar.addfile(info, io.BytesIO(data))


def sample_members(key: str, image: bytes, caption: bytes, meta: bytes, ext: str = "jpg") -> list[tuple]:
    """A sample's members in webdataset's TarWriter order (extensions sorted)."""
    return sorted([(f"{key}.{ext}", image), (f"{key}.json", meta), (f"{key}.txt", caption)])


def write_tar(path: Path, members: Iterable[tuple[str, bytes]]) -> None:
    """An img2dataset-style tar of `members` (name, bytes), written at once."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            _tar_member(tar, name, data)
    path.write_bytes(buffer.getvalue())


def _write_parquet(path: Path, records: list[dict[str, Any]], row_group_size: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(dict.fromkeys(name for record in records for name in record))  # union, first-seen order
    table = pa.Table.from_pydict({name: [record.get(name) for record in records] for name in columns})
    pq.write_table(table, path, row_group_size=row_group_size)


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=2).encode()


def build_webdataset(
    out_dir: Path,
    shards: int = 4,
    per_shard: int = 128,
    seed: int = 0,
    size: tuple[int, int] | None = None,
) -> list[Path]:
    """img2dataset webdataset output: {shard:05d}.tar ({key}.jpg/.json/.txt), .parquet and _stats.json.

    Each tar holds `per_shard` samples; the metadata parquet also lists a few failed downloads. Image
    sizes vary (tiny to wide) unless `size` = (width, height) fixes them, e.g. for benchmarks.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(shards):
        rows = _shard_rows(shard, per_shard, seed, size=size)
        members = []
        for row in rows:
            if row.image is not None:
                key = row.meta["key"]
                members += sample_members(key, row.image, row.meta["caption"].encode(), json_bytes(row.meta))
        tar_path = out_dir / f"{shard:05d}.tar"
        write_tar(tar_path, members)
        _write_parquet(out_dir / f"{shard:05d}.parquet", [row.meta for row in rows], PARQUET_ROW_GROUP)
        (out_dir / f"{shard:05d}_stats.json").write_bytes(json_bytes(_stats(shard, [r.meta for r in rows])))
        paths.append(tar_path)
    return paths


def build_parquet(out_dir: Path, shards: int = 2, per_shard: int = 64, seed: int = 1) -> list[Path]:
    """img2dataset parquet output: one row per URL (failed downloads have a null `jpg`), LAION-2B scores
    plus a LAION-400M `NSFW` column, written in small row groups."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(shards):
        rows = _shard_rows(shard, per_shard, seed, nsfw_column=True)
        records = [{**row.meta, "jpg": row.image} for row in rows]
        path = out_dir / f"{shard:05d}.parquet"
        _write_parquet(path, records, PARQUET_ROW_GROUP)
        (out_dir / f"{shard:05d}_stats.json").write_bytes(json_bytes(_stats(shard, [r.meta for r in rows])))
        paths.append(path)
    return paths


def build_image_folder(out_dir: Path, count: int = 48, seed: int = 2) -> Path:
    """A folder of images with `{name}.txt` captions: mostly .jpg, some .png, some in a subfolder, and a
    `{name}.json` metadata sidecar for every third image."""
    out_dir = Path(out_dir)
    for index in range(count):
        rng = np.random.default_rng([seed, index])
        spec = pick_spec(rng)
        folder = out_dir / "more" if index % FOLDER_SUBDIR_EVERY == FOLDER_SUBDIR_EVERY - 1 else out_dir
        folder.mkdir(parents=True, exist_ok=True)
        stem = folder / f"shapes_{index:04d}"
        img = render(spec, rng)
        if index % FOLDER_PNG_EVERY == FOLDER_PNG_EVERY - 1:
            data, ext = encode_image(img, "PNG"), "png"
        else:
            data, ext = jpeg(img, rng), "jpg"
        stem.with_suffix(f".{ext}").write_bytes(data)
        stem.with_suffix(".txt").write_text(spec.caption + "\n", encoding="utf-8")
        if index % FOLDER_JSON_EVERY == 0:
            meta = {"caption": spec.caption, "width": spec.width, "height": spec.height, **_laion_scores(rng)}
            stem.with_suffix(".json").write_bytes(json_bytes(meta))
    return out_dir


BUILDERS = ("webdataset", "parquet", "folder")


def build(fmt: str, root: Path, shards: int | None, per_shard: int | None, seed: int | None) -> Path:
    """Build one kind of sample data as `root/<fmt>`, builder defaults where an option is None; return what a
    `source.uri` should point at."""
    options = {"shards": shards, "per_shard": per_shard, "seed": seed}
    given = {name: value for name, value in options.items() if value is not None}
    out = Path(root) / fmt
    if fmt == "webdataset":
        build_webdataset(out, **given)
    elif fmt == "parquet":
        build_parquet(out, **given)
    elif fmt == "folder":
        build_image_folder(out, **({"seed": given["seed"]} if "seed" in given else {}))
    else:
        raise ValueError(f"unknown sample data format {fmt!r}; use one of {', '.join(BUILDERS)}")
    return out
