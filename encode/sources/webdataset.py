"""Stream img2dataset webdataset tars (local or S3) into samples, rejecting hostile members unread."""

from __future__ import annotations

import contextlib
import lzma
import posixpath
import tarfile
import zlib
from collections.abc import Iterator

from encode.config import SourceConfig
from encode.sources.base import RawSample, Rejected, make_sample, parse_json
from shared import storage

# Errors that mean "these bytes are not a valid (compressed) tar", as opposed to a failing storage read.
_TAR_FORMAT_ERRORS = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError)
# tarfile ends iteration quietly on these header errors; only EOFHeaderError (zero blocks) is a proper end.
_BAD_END_ERRORS = (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError, tarfile.InvalidHeaderError)
# By name: in TarInfo.fromtarfile the archive parameter is called `tarfile`, hiding the module.
EOFHeaderError, InvalidHeaderError = tarfile.EOFHeaderError, tarfile.InvalidHeaderError


class _RecordingTarInfo(tarfile.TarInfo):
    """Remembers why tarfile stopped reading headers (it ends quietly on a truncated header), whether it
    saw the end-of-archive zero blocks, and each damaged header it stepped over (`ignore_zeros`: tarfile
    then skips block by block to the next valid header instead of ending the tar there)."""

    @classmethod
    def fromtarfile(cls, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        try:
            return super().fromtarfile(tarfile)
        except Exception as err:
            tarfile.header_error = err  # type: ignore[attr-defined]
            if isinstance(err, EOFHeaderError):
                tarfile.zero_blocks = True  # type: ignore[attr-defined]
            elif isinstance(err, InvalidHeaderError):
                tarfile.skipped_header = True  # type: ignore[attr-defined]
                tarfile.zero_blocks = False  # type: ignore[attr-defined]  # zeros then data: not the end
            raise


def _properly_ended(archive: tarfile.TarFile) -> bool:
    """The stream ended after the end-of-archive zero blocks (not in a header, nor after a damaged one)."""
    error = getattr(archive, "header_error", None)
    return not isinstance(error, _BAD_END_ERRORS) or bool(getattr(archive, "zero_blocks", False))


class _TarGrouper:
    """Turns a stream of tar members into samples: members of one key are adjacent (webdataset order)."""

    def __init__(self, cfg: SourceConfig) -> None:
        self.cfg = cfg
        self.seen: set[str] = set()
        self.key: str | None = None  # the key being collected
        self.members: dict[str, bytes] = {}
        self.poison: str | None = None  # why the open sample is dropped (one of its members was bad)
        self.poison_next = False  # a damaged header was stepped over: the next sample may have lost members
        self.reading: str | None = None  # the member whose header or data is being read
        self.held = 0  # bytes of the open sample's members kept in memory (cfg.max_sample_bytes)
        # Only these member extensions are read; others are skipped unread (the stream seeks past them).
        self.used_exts = {e.lower() for e in cfg.image_exts} | {cfg.caption_ext.lower(), "json"}

    def read(self, archive: tarfile.TarFile) -> Iterator[RawSample | Rejected]:
        for member in archive:
            if getattr(archive, "skipped_header", False):
                # The member whose header was damaged is lost: it was the open sample's or the next
                # one's. Both go (counted): one that lost its .json would pass the metadata filters.
                archive.skipped_header = False  # type: ignore[attr-defined]
                self.poison = self.poison or "corrupt_tar"
                self.poison_next = True
            self.reading = member.name
            verdict = _member_verdict(member)
            if verdict is None:
                yield from self._add_member(archive, member)
            elif verdict:  # "" is a directory: nothing to count
                yield Rejected(_split_member(member.name)[0] or None, verdict)
            self.reading = None
        if getattr(archive, "skipped_header", False) or not _properly_ended(archive):
            raise tarfile.ReadError("archive ends without its end-of-archive blocks")

    def _add_member(
        self, archive: tarfile.TarFile, member: tarfile.TarInfo
    ) -> Iterator[RawSample | Rejected]:
        """Read a member into the open sample only if it is used and fits the sample's byte budget."""
        key, ext = _split_member(_normalize_member(member.name))
        yield from self._start(key)
        budget = self.cfg.max_sample_bytes
        if ext not in self.used_exts or ext in self.members:
            yield from self._add(member.name, None)
        elif member.size > budget:  # never read into memory: a hostile header can claim terabytes
            yield from self._add(member.name, None, "file_too_large")
        elif self.held + member.size > budget:
            yield from self._add(member.name, None, "sample_too_large")
        else:
            self.held += member.size
            yield from self._add(member.name, archive.extractfile(member).read())  # type: ignore[union-attr]

    def _start(self, key: str) -> Iterator[RawSample | Rejected]:
        """Finish the open sample when a member of another key arrives."""
        if key != self.key:
            yield from self.finish()
            self.key, self.members, self.poison, self.held = key, {}, None, 0
            if self.poison_next:
                self.poison, self.poison_next = "corrupt_tar", False

    def _add(
        self, name: str, data: bytes | None, poison: str | None = None
    ) -> Iterator[RawSample | Rejected]:
        key, ext = _split_member(_normalize_member(name))
        yield from self._start(key)
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
        yield make_sample(key, image, caption, parse_json(self.members.get("json")))

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
            # ignore_zeros: a damaged header mid-tar is stepped over to the next valid one (tarfile would end
            # the tar there, losing every later sample uncounted); _RecordingTarInfo tells the end apart.
            with tarfile.open(
                fileobj=stream, mode="r|*", tarinfo=_RecordingTarInfo, ignore_zeros=True
            ) as archive:
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
