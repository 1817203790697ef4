"""Read what users have (img2dataset webdataset tars, img2dataset parquet, a folder of images with .txt
captions; local or s3://) in a deterministic order, and never crash on the data itself.

The unit of work and of resumability is a `Partition`: one input shard, or one hash bucket of a folder.
`read_partition` yields `RawSample`s and `Rejected` records; anything wrong with the *data* (a truncated tar,
a zero-byte image, a caption that is not UTF-8, a member named `../evil.jpg`) becomes a `Rejected` with a
short reason, never an exception. Problems the user must fix (a missing brace-range member, an empty glob,
a parquet file without the configured image column) raise with a message naming the fix. A storage error
while streaming (a dropped S3 connection) propagates too: it is not the data's fault, and recording it
as a reject would mark a partition done with samples silently missing.

Everything here is plain data and functions, so partitions and the reader pickle into worker processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import lzma
import os
import posixpath
import re
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from encode.config import SourceConfig
from shared import storage
from shared.manifest import fingerprint

WEBDATASET = "webdataset"
PARQUET = "parquet"
FOLDER = "folder"
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
PARQUET_SUFFIXES = (".parquet",)
# Partition ids become folder names and S3 key segments: keep them short and plain.
MAX_ID_CHARS = 120
ID_HASH_CHARS = 10
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]+")
_PATTERN_CHARS = re.compile(r"[*?\[{]")
MISSING_SHOWN = 10  # how many missing brace-range members an error message lists
COPY_CHUNK_BYTES = 1 << 22
# A member or file bigger than this is rejected unread ("file_too_large"): a hostile tar header can claim
# terabytes, and real web images are a few MB (the decompression-bomb check handles pixel counts).
MAX_MEMBER_BYTES = 1 << 28
# Errors that mean "these bytes are not a valid (compressed) tar", as opposed to a failing storage read.
_TAR_FORMAT_ERRORS = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError)
# tarfile ends iteration quietly on these header errors; only EOFHeaderError (zero blocks) is a proper end.
_BAD_END_ERRORS = (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError, tarfile.InvalidHeaderError)


class SourceError(ValueError):
    """The input does not fit the source config (wrong format, missing column); the message names the fix."""


@dataclass(frozen=True)
class Partition:
    """One input shard (or one folder bucket): the unit of work and of resumability."""

    # Stable, filesystem/S3-safe and unique in the dataset: "00000.tar" -> "00000-tar",
    # "a/b/00001.parquet" -> "a-b-00001-parquet", folder buckets "folder-0007".
    id: str
    kind: str  # "webdataset" | "parquet" | "folder"
    # The input file(s): one tar/parquet; for a folder bucket its image files, in key order.
    uris: tuple[str, ...]
    # folder: the folder the keys are relative to; other kinds: the dataset root the id was derived from.
    root: str = ""
    # folder: the caption/metadata sidecar files that exist for the bucket's images (part of the input).
    sidecars: tuple[str, ...] = ()
    # size + version of every file in `uris` and `sidecars` as listed (saves a stat per file); empty:
    # `source_fingerprint` stats them.
    listed: tuple[storage.FileInfo, ...] = field(default=(), compare=False, repr=False)

    def files(self) -> tuple[str, ...]:
        """Every input file whose bytes this partition's samples come from."""
        return self.uris + self.sidecars

    def source_fingerprint(self) -> str:
        """Identity of the input bytes: uri + size + version of every file; a changed file changes it."""
        known = {info.uri: info for info in self.listed}
        infos = [known.get(uri) or storage.stat(uri) for uri in self.files()]
        return fingerprint([self.kind, [[info.uri, info.size, info.version] for info in infos]])


@dataclass
class RawSample:
    key: str  # img2dataset key / parquet key column / folder: path relative to the root without extension
    image: bytes | None
    caption: str | None  # decoded UTF-8, raw (not cleaned)
    meta: dict[str, Any]  # metadata as read: img2dataset .json fields, parquet columns except the image


@dataclass
class Rejected:
    key: str | None
    reason: str  # short snake_case reason, e.g. "missing_image", "corrupt_tar", "duplicate_key"
    count: int = 1  # e.g. a corrupt parquet row group: the rows that could not be read


# ------------------------------------------------------------------------------------------- listing
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
    if _PATTERN_CHARS.search(uri):
        return _expand_inputs(uri), _static_root(uri)
    if not storage.is_s3(uri) and os.path.isfile(uri):
        return [storage.stat(uri)], os.path.dirname(uri) or "."
    files = [info for info in storage.list_files(uri) if not _is_hidden(info.uri, uri)]
    if storage.is_s3(uri) and not files:  # maybe a single object rather than a prefix
        with contextlib.suppress(FileNotFoundError):
            return [storage.stat(uri)], uri.rsplit("/", 1)[0]
    if not files:
        raise FileNotFoundError(f"source.uri {uri} does not exist or holds no files; check the path")
    return files, uri


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
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") % buckets


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
        sidecars = sorted({s for info in members for s in _sidecars_of(info.uri, cfg) if s in by_uri})
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


def _sidecars_of(image_uri: str, cfg: SourceConfig) -> tuple[str, str]:
    stem = posixpath.splitext(image_uri)[0] if storage.is_s3(image_uri) else os.path.splitext(image_uri)[0]
    return f"{stem}.{cfg.caption_ext}", f"{stem}.json"


# ------------------------------------------------------------------------------------------- reading
def read_partition(partition: Partition, cfg: SourceConfig) -> Iterator[RawSample | Rejected]:
    """Every sample of a partition in a deterministic order, with each unusable one as a `Rejected`."""
    if partition.kind == WEBDATASET:
        for uri in partition.uris:
            yield from read_webdataset(uri, cfg)
    elif partition.kind == PARQUET:
        for uri in partition.uris:
            yield from read_parquet(uri, cfg)
    elif partition.kind == FOLDER:
        yield from read_folder(partition, cfg)
    else:
        raise SourceError(f"unknown partition kind {partition.kind!r} (expected webdataset, parquet, folder)")


class _RecordingTarInfo(tarfile.TarInfo):
    """Remembers why tarfile stopped reading headers: it ends quietly on a truncated header."""

    @classmethod
    def fromtarfile(cls, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        try:
            return super().fromtarfile(tarfile)
        except Exception as err:
            tarfile.header_error = err  # type: ignore[attr-defined]
            raise


class _TarGrouper:
    """Turns a stream of tar members into samples: members of one key are adjacent (webdataset order)."""

    def __init__(self, cfg: SourceConfig) -> None:
        self.cfg = cfg
        self.seen: set[str] = set()
        self.key: str | None = None  # the key being collected
        self.members: dict[str, bytes] = {}
        self.poison: str | None = None  # why the open sample is dropped (one of its members was bad)
        self.reading: str | None = None  # the member whose header or data is being read

    def read(self, archive: tarfile.TarFile) -> Iterator[RawSample | Rejected]:
        for member in archive:
            self.reading = member.name
            verdict = _member_verdict(member)
            if verdict is None and member.size > MAX_MEMBER_BYTES:  # never read into memory
                yield from self._add(member.name, None, "file_too_large")
            elif verdict is None:
                yield from self._add(member.name, archive.extractfile(member).read())  # type: ignore[union-attr]
            elif verdict:  # "" is a directory: nothing to count
                yield Rejected(_split_member(member.name)[0] or None, verdict)
            self.reading = None
        if isinstance(getattr(archive, "header_error", None), _BAD_END_ERRORS):
            raise tarfile.ReadError("archive ends without its end-of-archive blocks")

    def _add(
        self, name: str, data: bytes | None, poison: str | None = None
    ) -> Iterator[RawSample | Rejected]:
        key, ext = _split_member(_normalize_member(name))
        if key != self.key:
            yield from self.finish()
            self.key, self.members, self.poison = key, {}, None
        if ext in self.members:  # two `{key}.txt`: which one is the caption is anyone's guess
            poison = "duplicate_member"
        self.poison = self.poison or poison
        if data is not None and ext not in self.members:
            self.members[ext] = data

    def finish(self) -> Iterator[RawSample | Rejected]:
        """The sample collected so far (if any)."""
        if self.key is None:
            return
        key, self.key = self.key, None
        if key in self.seen:
            yield Rejected(key, "duplicate_key")
            return
        self.seen.add(key)
        if self.poison:
            yield Rejected(key, self.poison)
            return
        image_ext = next((e.lower() for e in self.cfg.image_exts if e.lower() in self.members), None)
        image = self.members.get(image_ext) if image_ext else None
        caption = self.members.get(self.cfg.caption_ext.lower())
        yield _make_sample(key, image, caption, _parse_json(self.members.get("json")))

    def broken(self) -> Iterator[Rejected]:
        """After the tar broke: the open sample goes down with it. It may be incomplete, and one that lost
        its .json would slip past the metadata filters (punsafe, ...) unchecked."""
        broken_key = _split_member(_normalize_member(self.reading))[0] if self.reading else None
        key, self.key = self.key, None
        yield Rejected(key or broken_key, "corrupt_tar")


def read_webdataset(uri: str, cfg: SourceConfig) -> Iterator[RawSample | Rejected]:
    """Stream one (possibly compressed) tar, from local disk or S3, without extracting it anywhere.

    A truncated or corrupt tar yields every sample completed before the damage, then one
    Rejected("corrupt_tar") for the sample being read (count 1: what followed is unknowable from a stream).
    """
    grouper = _TarGrouper(cfg)
    with contextlib.closing(storage.open_read(uri)) as stream:
        try:
            with tarfile.open(fileobj=stream, mode="r|*", tarinfo=_RecordingTarInfo) as archive:
                yield from grouper.read(archive)
        except _TAR_FORMAT_ERRORS:
            yield from grouper.broken()
            return
    yield from grouper.finish()


def _member_verdict(member: tarfile.TarInfo) -> str | None:
    """None: a regular member to read; "": skip quietly (a directory); else the reason to reject it."""
    if member.isdir():
        return ""
    if not member.isfile():  # symlinks, hard links, devices, fifos: never followed
        return "unsafe_member_name"
    name = member.name
    if name.startswith("/") or "\\" in name or "\x00" in name or ".." in name.split("/"):
        return "unsafe_member_name"
    key, ext = _split_member(_normalize_member(name))
    if not key or not ext:
        return "bad_member_name"
    return None


def _normalize_member(name: str) -> str:
    """`./000001.jpg` -> `000001.jpg` (tars made with `tar -C dir .` carry the prefix)."""
    return posixpath.normpath(name).lstrip("/") if name else name


def _split_member(name: str) -> tuple[str, str]:
    """webdataset convention: key = path up to the first dot of the file name, ext = the rest, lowercased."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    key = f"{folder}/{stem}" if folder and stem else stem
    return key, ext.lower()


def _make_sample(
    key: str, image: bytes | None, caption: bytes | str | None, meta: dict[str, Any]
) -> RawSample | Rejected:
    """The checks every format shares: an image with bytes and a caption that is text."""
    if image is None:
        return Rejected(key, "missing_image")
    if len(image) == 0:
        return Rejected(key, "empty_image_file")
    if caption is None:
        return Rejected(key, "missing_caption")
    if isinstance(caption, bytes):
        try:
            caption = caption.decode("utf-8")
        except UnicodeDecodeError:
            return Rejected(key, "caption_not_utf8")
    return RawSample(key=key, image=image, caption=caption, meta=meta)


def _parse_json(data: bytes | None) -> dict[str, Any]:
    """img2dataset metadata; unreadable or not an object -> {} (the sample itself is still good)."""
    if not data:
        return {}
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


# ------------------------------------------------------------------------------------------- parquet
def read_parquet(uri: str, cfg: SourceConfig) -> Iterator[RawSample | Rejected]:
    """img2dataset parquet output, one row group at a time (a shard's images never sit in memory at once)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _seekable(uri) as handle:
        try:
            parquet = pq.ParquetFile(handle)
        except (pa.ArrowException, OSError):
            yield Rejected(None, "corrupt_parquet")
            return
        _check_columns(uri, parquet.schema_arrow.names, cfg)
        seen: set[str] = set()
        for index in range(parquet.num_row_groups):
            try:
                table = parquet.read_row_group(index)
            except (pa.ArrowException, OSError):
                unread = sum(
                    parquet.metadata.row_group(i).num_rows for i in range(index, parquet.num_row_groups)
                )
                yield Rejected(None, "corrupt_parquet", count=max(unread, 1))
                return
            yield from _parquet_rows(table.to_pydict(), uri, index, seen, cfg)


def _rows_from(parquet: Any, first_group: int) -> int:
    """Rows in row groups `first_group`.. (what a corrupt row group takes down with it), at least 1."""
    groups = range(first_group, parquet.num_row_groups)
    return max(1, sum(parquet.metadata.row_group(i).num_rows for i in groups))


@contextlib.contextmanager
def _seekable(uri: str) -> Iterator[IO[bytes]]:
    """Parquet needs random access: local files open directly, S3 objects are spooled to a temp file."""
    if not storage.is_s3(uri):
        with open(uri, "rb") as handle:
            yield handle
        return
    with tempfile.TemporaryFile(prefix="sd-encode-parquet-") as spool:
        with contextlib.closing(storage.open_read(uri)) as stream:
            shutil.copyfileobj(stream, spool, COPY_CHUNK_BYTES)
        spool.seek(0)
        yield spool


def _check_columns(uri: str, names: list[str], cfg: SourceConfig) -> None:
    for column, setting in ((cfg.image_column, "image_column"), (cfg.caption_column, "caption_column")):
        if column not in names:
            raise SourceError(
                f"parquet file {uri} has no column {column!r} (columns: {', '.join(names)}); set "
                f"source.{setting}, or for img2dataset webdataset output (metadata-only .parquet next to "
                ".tar files) point source.uri at the .tar files"
            )


def _parquet_rows(
    columns: dict[str, list[Any]], uri: str, group_index: int, seen: set[str], cfg: SourceConfig
) -> Iterator[RawSample | Rejected]:
    images = columns[cfg.image_column]
    captions = columns[cfg.caption_column]
    keys = columns.get(cfg.key_column)
    meta_names = [name for name in columns if name != cfg.image_column]
    stem = posixpath.splitext(uri.rsplit("/", 1)[-1])[0]
    for row, image in enumerate(images):
        key = str(keys[row]) if keys is not None and keys[row] is not None else f"{stem}-{group_index}-{row}"
        if key in seen:
            yield Rejected(key, "duplicate_key")
            continue
        seen.add(key)
        meta = {name: columns[name][row] for name in meta_names}
        yield _make_sample(key, image, captions[row], meta)


# -------------------------------------------------------------------------------------------- folder
def read_folder(partition: Partition, cfg: SourceConfig) -> Iterator[RawSample | Rejected]:
    """The bucket's images in key order, each with its `{stem}.txt` caption and optional `{stem}.json`."""
    sidecars = set(partition.sidecars)
    listed_sizes = {info.uri: info.size for info in partition.listed}
    seen: set[str] = set()
    for uri in partition.uris:
        key = folder_key(uri, partition.root)
        if key in seen:  # a.jpg and a.png: one key, keep the first
            yield Rejected(key, "duplicate_key")
            continue
        seen.add(key)
        if listed_sizes.get(uri, 0) > MAX_MEMBER_BYTES:
            yield Rejected(key, "file_too_large")
            continue
        caption_uri, json_uri = _sidecars_of(uri, cfg)
        image = _read_optional(uri)
        caption = _read_optional(caption_uri) if caption_uri in sidecars else None
        meta = _parse_json(_read_optional(json_uri)) if json_uri in sidecars else {}
        if image is None:  # deleted since listing
            yield Rejected(key, "missing_image")
            continue
        yield _make_sample(key, image, caption, meta)


def _read_optional(uri: str) -> bytes | None:
    try:
        return storage.read_bytes(uri)
    except FileNotFoundError:
        return None


def count_by_reason(items: Iterable[RawSample | Rejected]) -> dict[str, int]:
    """{"good": n, reason: n, ...} over what `read_partition` yielded (for reports and tests)."""
    counts: dict[str, int] = {}
    for item in items:
        name = item.reason if isinstance(item, Rejected) else "good"
        counts[name] = counts.get(name, 0) + (item.count if isinstance(item, Rejected) else 1)
    return counts
