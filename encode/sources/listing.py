"""List a source's partitions: tars, parquet files, or hash buckets of a folder; deterministic ids."""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import re

from encode.config import SourceConfig
from encode.sources.base import FOLDER, PARQUET, WEBDATASET, Partition, SourceError
from shared import storage

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
PARQUET_SUFFIXES = (".parquet",)
# Partition ids become folder names and S3 key segments: keep them short and plain.
MAX_ID_CHARS = 120
ID_HASH_CHARS = 10
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]+")
_PATTERN_CHARS = re.compile(r"[*?\[{]")
MISSING_SHOWN = 10  # how many missing brace-range members an error message lists
# Where jobs/datasets/sample.yaml expects the sample data `python -m encode sample-data` builds.
SAMPLE_DATA_DIR = "outputs/demo/sample-data"


def list_partitions(cfg: SourceConfig) -> list[Partition]:
    """The dataset's partitions, sorted by id (deterministic), at most `cfg.max_partitions` of them."""
    files, root = _resolve_inputs(cfg.uri)
    kind = _detect_format(files, cfg)
    chosen = [info for info in files if _matches_kind(info.uri, kind, cfg)]
    if not chosen:
        raise SourceError(f"{cfg.uri} holds no {kind} input files ({_kind_hint(kind, cfg)})")
    if kind == FOLDER:
        partitions = _folder_partitions(chosen, files, root, cfg)
    else:
        partitions = _file_partitions(chosen, root, kind)
    partitions.sort(key=lambda p: p.id)
    if cfg.max_partitions is not None:
        partitions = partitions[: cfg.max_partitions]
    return partitions


def _resolve_inputs(uri: str) -> tuple[list[storage.FileInfo], str]:
    """Every file the source URI names, and the root that partition ids and keys are relative to."""
    uri = uri.rstrip("/") or uri
    if "://" not in uri:  # one spelling of a local path (./x, x/, ../d/x, /abs/x): its files' URIs are
        uri = os.path.abspath(uri)  # in the source fingerprint, so another spelling would redo everything
    if _PATTERN_CHARS.search(uri):
        return _expand_inputs(uri), _static_root(uri)
    if not storage.is_s3(uri) and os.path.isfile(uri):
        return [storage.stat(uri)], os.path.dirname(uri) or "."
    files = [info for info in storage.list_files(uri) if not _is_hidden(info.uri, uri)]
    if storage.is_s3(uri) and not files:  # maybe a single object rather than a prefix
        with contextlib.suppress(FileNotFoundError):
            return [storage.stat(uri)], uri.rsplit("/", 1)[0]
    if not files:
        raise FileNotFoundError(f"source.uri {uri} does not exist or holds no files; {_missing_hint(uri)}")
    return files, uri


def _missing_hint(uri: str) -> str:
    """How to get a missing source: the sample data (jobs/datasets/sample.yaml) is built, not shipped."""
    if SAMPLE_DATA_DIR in uri:
        return (
            f"build the bundled sample data first: `python -m encode sample-data --out {SAMPLE_DATA_DIR}` "
            "(or `make demo`, which builds it, encodes it and trains on it)"
        )
    return "check the path"


def _expand_inputs(pattern: str) -> list[storage.FileInfo]:
    """Brace ranges name files that must all exist; globs match what exists (and must match something)."""
    root = _static_root(pattern)
    named = [uri for uri in storage.expand_pattern(pattern) if not _is_hidden(uri, root)]
    if not named:
        raise FileNotFoundError(f"source.uri pattern {pattern} matches no files; check the path and pattern")
    infos = _stat_many(named)
    missing = [uri for uri in named if uri not in infos]
    if missing:
        shown = ", ".join(missing[:MISSING_SHOWN])
        more = f" and {len(missing) - MISSING_SHOWN} more" if len(missing) > MISSING_SHOWN else ""
        raise FileNotFoundError(
            f"source.uri {pattern} names {len(missing)} file(s) that do not exist: {shown}{more}; "
            "fix the brace range (e.g. {00000..00041}) so it covers only shards that exist"
        )
    return [infos[uri] for uri in named]


def _stat_many(uris: list[str]) -> dict[str, storage.FileInfo]:
    """FileInfo of each uri that exists; on S3 one listing per parent prefix instead of a HEAD per file."""
    found: dict[str, storage.FileInfo] = {}
    if not any(storage.is_s3(uri) for uri in uris):
        for uri in uris:
            with contextlib.suppress(FileNotFoundError):
                found[uri] = storage.stat(uri)
        return found
    wanted = set(uris)
    for parent in sorted({uri.rsplit("/", 1)[0] for uri in uris}):
        found.update({i.uri: i for i in storage.list_files(parent) if i.uri in wanted})
    return found


def _is_hidden(uri: str, root: str) -> bool:
    """Dot files below the root (.DS_Store, ._x.jpg resource forks, half-written .x.tmp) are not input."""
    prefix = root.rstrip("/") + "/"
    relative = uri[len(prefix) :] if root not in ("", ".") and uri.startswith(prefix) else uri
    return any(part.startswith(".") and part not in (".", "..") for part in relative.split("/"))


def _static_root(pattern: str) -> str:
    """The folder part of `pattern` before its first glob or brace character."""
    head = pattern[: _PATTERN_CHARS.search(pattern).start()]  # type: ignore[union-attr]
    return head.rsplit("/", 1)[0] if "/" in head else "."


def _suffix_of(uri: str) -> str:
    name = uri.rsplit("/", 1)[-1].lower()
    for suffix in (*TAR_SUFFIXES, *PARQUET_SUFFIXES):
        if name.endswith(suffix):
            return suffix
    return posixpath.splitext(name)[1]


def _is_image(uri: str, cfg: SourceConfig) -> bool:
    return _suffix_of(uri).lstrip(".") in {ext.lower().lstrip(".") for ext in cfg.image_exts}


def _matches_kind(uri: str, kind: str, cfg: SourceConfig) -> bool:
    if kind == WEBDATASET:
        return _suffix_of(uri) in TAR_SUFFIXES
    if kind == PARQUET:
        return _suffix_of(uri) in PARQUET_SUFFIXES
    return _is_image(uri, cfg)


def _detect_format(files: list[storage.FileInfo], cfg: SourceConfig) -> str:
    """auto: tars win (img2dataset writes metadata .parquet files next to its tars), then parquet, images."""
    if cfg.format != "auto":
        return cfg.format
    for kind in (WEBDATASET, PARQUET, FOLDER):
        if any(_matches_kind(info.uri, kind, cfg) for info in files):
            return kind
    exts = sorted({_suffix_of(info.uri) or "<none>" for info in files})
    raise SourceError(
        f"cannot tell the format of {cfg.uri}: no .tar, .parquet or image files "
        f"({', '.join(cfg.image_exts)}) among its files (extensions: {', '.join(exts[:10])}); set "
        "source.format or source.image_exts"
    )


def _kind_hint(kind: str, cfg: SourceConfig) -> str:
    if kind == WEBDATASET:
        return f"looked for {', '.join(TAR_SUFFIXES)}"
    if kind == PARQUET:
        return "looked for .parquet"
    return f"looked for images with extensions {', '.join(cfg.image_exts)}; see source.image_exts"


def partition_id(relative: str) -> str:
    """A filesystem/S3-safe id from a path relative to the dataset root: "a/b/00001.tar" -> "a-b-00001-tar".

    Paths that would lose information (other characters, or a very long path) get a short hash suffix so
    two different paths never share an id.
    """
    plain = relative.replace("/", "-").replace(".", "-")
    cleaned = _UNSAFE_ID_CHARS.sub("_", plain).strip("-_") or "input"
    if cleaned == plain and len(cleaned) <= MAX_ID_CHARS:
        return cleaned
    digest = hashlib.sha1(relative.encode()).hexdigest()[:ID_HASH_CHARS]
    return f"{cleaned[: MAX_ID_CHARS - ID_HASH_CHARS - 1]}-{digest}"


def _file_partitions(files: list[storage.FileInfo], root: str, kind: str) -> list[Partition]:
    partitions = [
        Partition(partition_id(_relative(info.uri, root)), kind, (info.uri,), root, listed=(info,))
        for info in files
    ]
    return _disambiguate(partitions)


def _relative(uri: str, root: str) -> str:
    if root in ("", "."):
        return uri.lstrip("/") if storage.is_s3(uri) else os.path.relpath(uri).replace(os.sep, "/")
    return storage.relpath(uri, root).replace(os.sep, "/")


def _disambiguate(partitions: list[Partition]) -> list[Partition]:
    """Two files mapping to one id (e.g. "a-b/c.tar" and "a/b-c.tar"): suffix both with a hash of the uri."""
    seen: dict[str, int] = {}
    for part in partitions:
        seen[part.id] = seen.get(part.id, 0) + 1
    out = []
    for part in partitions:
        if seen[part.id] > 1:
            digest = hashlib.sha1(part.uris[0].encode()).hexdigest()[:ID_HASH_CHARS]
            part = Partition(f"{part.id}-{digest}", part.kind, part.uris, part.root, listed=part.listed)
        out.append(part)
    return out


# ------------------------------------------------------------------------------------ folder buckets
def folder_key(uri: str, root: str) -> str:
    """A folder sample's key: its path relative to the root, without the extension."""
    return posixpath.splitext(_relative(uri, root))[0]


def folder_bucket(key: str, buckets: int) -> int:
    """Stable bucket of a key (sha1, not Python's salted hash): adding an image moves no other image."""
    # surrogateescape: a file name that is not UTF-8 still has a bucket (select_sample rejects the sample)
    return int.from_bytes(hashlib.sha1(key.encode("utf-8", "surrogateescape")).digest()[:8], "big") % buckets


def _folder_partitions(
    images: list[storage.FileInfo], files: list[storage.FileInfo], root: str, cfg: SourceConfig
) -> list[Partition]:
    """Hash each image's key into one of `cfg.folder_partitions` buckets; empty buckets are no partition."""
    if cfg.folder_partitions < 1:
        raise SourceError("source.folder_partitions must be >= 1")
    by_uri = {info.uri: info for info in files}
    width = max(4, len(str(cfg.folder_partitions - 1)))
    buckets: dict[int, list[storage.FileInfo]] = {}
    for info in images:
        buckets.setdefault(folder_bucket(folder_key(info.uri, root), cfg.folder_partitions), []).append(info)
    partitions = []
    for number, members in sorted(buckets.items()):
        members.sort(key=lambda info: (folder_key(info.uri, root), info.uri))
        sidecars = sorted({s for info in members for s in sidecars_of(info.uri, cfg) if s in by_uri})
        partitions.append(
            Partition(
                id=f"folder-{number:0{width}d}",
                kind=FOLDER,
                uris=tuple(info.uri for info in members),
                root=root,
                sidecars=tuple(sidecars),
                listed=tuple(members) + tuple(by_uri[s] for s in sidecars),
            )
        )
    return partitions


def sidecars_of(image_uri: str, cfg: SourceConfig) -> tuple[str, str]:
    stem = posixpath.splitext(image_uri)[0] if storage.is_s3(image_uri) else os.path.splitext(image_uri)[0]
    return f"{stem}.{cfg.caption_ext}", f"{stem}.json"
