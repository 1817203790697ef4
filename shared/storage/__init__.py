"""One small API over local paths and `s3://` URIs.

S3 goes through boto3 and honours `S3_ENDPOINT_URL`, the same variable MosaicML Streaming reads, so one
setting points both the encode writer and the train reader at MinIO / SeaweedFS / R2 / a VPC endpoint.
Local writes are atomic (temp file + rename); an S3 PUT is atomic by itself.
"""

from __future__ import annotations

import collections
import errno
import fnmatch
import functools
import json
import os
import re
import shutil
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from shared.storage import transfers

# Re-exported: callers use `storage.StorageError`, `storage.redact_url`, ... as one API.
from shared.storage.errors import StorageError as StorageError
from shared.storage.errors import is_missing, is_transient, storage_error
from shared.storage.safety import REDACTED as REDACTED
from shared.storage.safety import contained_path as contained_path
from shared.storage.safety import private_temp_dir as private_temp_dir
from shared.storage.safety import redact_url as redact_url
from shared.storage.safety import unsafe_name_reason as unsafe_name_reason
from shared.storage.transfers import download_file, get_bytes, open_resuming, retried, upload_file

S3_SCHEME = "s3://"
_BRACE_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_GLOB_CHARS = re.compile(r"[*?\[]")


def is_s3(uri: str) -> bool:
    return str(uri).startswith(S3_SCHEME)


def split_s3(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> (`bucket`, `a/b`)."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise StorageError(f"not an s3 URI: {redact_url(uri)!r} (expected s3://bucket/prefix)")
    return parsed.netloc, parsed.path.lstrip("/")


def join(base: str, *parts: str) -> str:
    """Join path parts with `/` for S3 and os.path semantics for local paths."""
    if is_s3(base):
        out = base.rstrip("/")
        for part in parts:
            out += "/" + str(part).strip("/")
        return out
    return os.path.join(base, *parts)


def relpath(uri: str, base: str) -> str:
    """`uri` relative to `base` (both local or both s3)."""
    if is_s3(base):
        prefix = base.rstrip("/") + "/"
        if not uri.startswith(prefix):
            raise StorageError(f"{uri} is not under {base}")
        return uri[len(prefix) :]
    return os.path.relpath(uri, base)


@functools.lru_cache(maxsize=4)
def _client(endpoint: str | None) -> Any:
    import boto3
    from botocore.config import Config

    # A fresh session, not boto3's default one: that caches the credentials it first resolved, so a
    # changed AWS_ACCESS_KEY_ID would be ignored even after `_client.cache_clear()`.
    session = boto3.session.Session()
    client = session.client(
        "s3", endpoint_url=endpoint, config=Config(retries={"max_attempts": transfers.BOTOCORE_ATTEMPTS})
    )
    client.meta.events.register("before-call.s3", _count_request)
    return client


# Every S3 API call made through s3_client(), by operation name (ListObjectsV2, GetObject, ...): tests
# and `make bench` read it to prove per-step costs stay at zero (issue 11). Retries count once.
_REQUEST_COUNTS: collections.Counter[str] = collections.Counter()
_REQUEST_COUNTS_LOCK = threading.Lock()


def _count_request(model: Any, **_: Any) -> None:
    with _REQUEST_COUNTS_LOCK:
        _REQUEST_COUNTS[model.name] += 1


def request_counts() -> dict[str, int]:
    """S3 requests this process made through s3_client() so far, by operation name."""
    with _REQUEST_COUNTS_LOCK:
        return dict(_REQUEST_COUNTS)


def s3_client() -> Any:
    """A boto3 S3 client for the endpoint in `S3_ENDPOINT_URL` (unset: AWS)."""
    return _client(os.environ.get("S3_ENDPOINT_URL") or None)


def s3_error(err: Exception, uri: str) -> StorageError:
    """Our message with botocore's text in it, both redacted: raise it `from None`, since a chained
    botocore exception would print the endpoint's password again in the traceback."""
    endpoint = redact_url(os.environ.get("S3_ENDPOINT_URL"))
    return storage_error(
        f"S3 request for {uri} failed: {redact_url(str(err))}. Check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
        f"and, for a non-AWS server, S3_ENDPOINT_URL (now {endpoint!r}).",
        transient=is_transient(err),
    )


def read_bytes(uri: str) -> bytes:
    if not is_s3(uri):
        try:
            return Path(uri).read_bytes()
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{uri} does not exist") from err
    bucket, key = split_s3(uri)
    try:
        return get_bytes(s3_client(), bucket, key)  # repeated when it fails in transit (transfers.py)
    except Exception as err:
        if is_missing(err):
            raise FileNotFoundError(f"{uri} does not exist") from err
        raise s3_error(err, uri) from None


def read_json(uri: str) -> Any:
    return json.loads(read_bytes(uri))


def write_bytes(uri: str, data: bytes) -> None:
    """Write atomically: readers see the old object or the new one, never a torn one."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        try:
            client = s3_client()
            retried(lambda: client.put_object(Bucket=bucket, Key=key, Body=data), f"writing {uri}", client)
        except Exception as err:
            raise s3_error(err, uri) from None
        return
    path = Path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _new_file_mode())  # mkstemp makes 0600; others sharing the output must read it
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@functools.lru_cache(maxsize=1)
def _new_file_mode() -> int:
    """The mode `open()` would give a new file under the process umask (read once: umask is process-wide)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_json(uri: str, obj: Any) -> None:
    write_bytes(uri, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def exists(uri: str) -> bool:
    if not is_s3(uri):
        return os.path.exists(uri)
    bucket, key = split_s3(uri)
    try:
        client = s3_client()
        retried(lambda: client.head_object(Bucket=bucket, Key=key), f"checking {uri}", client)
        return True
    except Exception as err:
        if is_missing(err):
            return False
        raise s3_error(err, uri) from None


@dataclass(frozen=True)
class FileInfo:
    uri: str
    size: int
    version: str  # mtime (local) or ETag (S3): changes when the content is replaced
    modified: float = 0.0  # seconds since the epoch it was last written (local mtime, S3 LastModified)


def list_files(prefix: str) -> list[FileInfo]:
    """Every file under `prefix` (a folder), recursively, sorted by URI."""
    if not is_s3(prefix):
        root = Path(prefix)
        if not root.exists():
            return []
        if root.is_file():
            return [_local_info(root)]
        return sorted(
            (_local_info(p) for p in root.rglob("*") if p.is_file()),
            key=lambda info: info.uri,
        )
    bucket, key = split_s3(prefix)
    key = key.rstrip("/") + "/" if key else ""
    out = []
    try:
        paginator = s3_client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=key):
            for obj in page.get("Contents", []):
                uri = f"{S3_SCHEME}{bucket}/{obj['Key']}"
                modified = obj["LastModified"].timestamp() if "LastModified" in obj else 0.0
                out.append(FileInfo(uri, int(obj["Size"]), str(obj.get("ETag", "")).strip('"'), modified))
    except Exception as err:
        raise s3_error(err, prefix) from None
    return sorted(out, key=lambda info: info.uri)


def _local_info(path: Path) -> FileInfo:
    stat = path.stat()
    return FileInfo(str(path), stat.st_size, str(stat.st_mtime_ns), stat.st_mtime)


def stat(uri: str) -> FileInfo:
    if not is_s3(uri):
        if not os.path.isfile(uri):
            raise FileNotFoundError(f"{uri} does not exist")
        return _local_info(Path(uri))
    bucket, key = split_s3(uri)
    try:
        client = s3_client()
        head = retried(lambda: client.head_object(Bucket=bucket, Key=key), f"checking {uri}", client)
    except Exception as err:
        if is_missing(err):
            raise FileNotFoundError(f"{uri} does not exist") from err
        raise s3_error(err, uri) from None
    return FileInfo(uri, int(head["ContentLength"]), str(head.get("ETag", "")).strip('"'))


def open_read(uri: str) -> IO[bytes]:
    """A binary stream (S3: streamed, not buffered whole in memory)."""
    if not is_s3(uri):
        try:
            return open(uri, "rb")  # the caller closes it
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{uri} does not exist") from err
    bucket, key = split_s3(uri)
    try:
        return open_resuming(s3_client(), bucket, key)  # resumes where a broken body stopped (transfers.py)
    except Exception as err:
        if is_missing(err):
            raise FileNotFoundError(f"{uri} does not exist") from err
        raise s3_error(err, uri) from None


def delete(uri: str) -> None:
    if not is_s3(uri):
        Path(uri).unlink(missing_ok=True)
        return
    bucket, key = split_s3(uri)
    try:
        s3_client().delete_object(Bucket=bucket, Key=key)
    except Exception as err:
        raise s3_error(err, uri) from None


def delete_tree(uri: str) -> None:
    """Remove a folder and everything under it."""
    if not is_s3(uri):
        shutil.rmtree(uri, ignore_errors=True)
        return
    for info in list_files(uri):
        delete(info.uri)


def upload_dir(local_dir: str | Path, uri: str) -> None:
    """Copy a local folder's files to `uri` (local: move it into place with one rename)."""
    local_dir = Path(local_dir)
    if not is_s3(uri):
        target = Path(uri)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # a leftover from an interrupted run that was never published
            shutil.rmtree(target)
        try:
            os.replace(local_dir, target)
        except OSError as err:
            if err.errno != errno.EXDEV:
                raise
            _copy_then_rename(local_dir, target)  # a temp dir on another filesystem (e.g. tmpfs /tmp)
        return
    bucket, key = split_s3(uri)
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        dest = f"{key.rstrip('/')}/{path.relative_to(local_dir).as_posix()}"
        try:
            upload_file(s3_client(), str(path), bucket, dest)
        except Exception as err:
            raise s3_error(err, f"{S3_SCHEME}{bucket}/{dest}") from None


def _copy_then_rename(local_dir: Path, target: Path) -> None:
    """Cross-filesystem publish: copy next to `target`, rename into place, then drop the source."""
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        shutil.copytree(local_dir, staging, dirs_exist_ok=True)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(local_dir, ignore_errors=True)


def download_dir(uri: str, local_dir: str | Path) -> Path:
    """Copy every file under `uri` into `local_dir`, keeping relative paths.

    Every name is checked before anything is copied: an S3 key such as `prefix/../../x` or `prefix//etc/x`
    must not map outside `local_dir`.
    """
    local_dir = Path(local_dir)
    plan = [(f.uri, contained_path(local_dir, relpath(f.uri, uri), f.uri)) for f in list_files(uri)]
    for src, dest in plan:
        dest.parent.mkdir(parents=True, exist_ok=True)
        download(src, dest)
    return local_dir


def download(uri: str, dest: str | Path) -> None:
    """Copy one file to the local path `dest` (S3: s3transfer's parallel download, repeated when it fails in
    transit, shared/storage/transfers.py)."""
    if not is_s3(uri):
        shutil.copyfile(uri, dest)
        return
    bucket, key = split_s3(uri)
    try:
        download_file(s3_client(), bucket, key, str(dest))
    except Exception as err:
        if is_missing(err):
            raise FileNotFoundError(f"{uri} does not exist") from err
        raise s3_error(err, uri) from None


def expand_braces(pattern: str) -> list[str]:
    """Expand numeric brace ranges, keeping zero padding: `{00000..00002}.tar` -> 3 names."""
    match = _BRACE_RANGE.search(pattern)
    if not match:
        return [pattern]
    lo, hi = match.group(1), match.group(2)
    # Like bash: a zero-padded end (`{00000..41455}`, `{1..010}`) pads every name to the longer end's width.
    padded = any(end.startswith("0") and len(end) > 1 for end in (lo, hi))
    width = max(len(lo), len(hi)) if padded else 0
    if int(hi) < int(lo):
        raise StorageError(f"brace range {match.group(0)} in {pattern!r} runs backwards")
    head, tail = pattern[: match.start()], pattern[match.end() :]
    out = []
    for number in range(int(lo), int(hi) + 1):
        out.extend(expand_braces(f"{head}{str(number).zfill(width)}{tail}"))
    return out


def expand_pattern(pattern: str) -> list[str]:
    """Brace ranges and shell globs (`*`, `?`, `[...]`) over local paths or S3 keys, sorted.

    A brace range names files that must exist; a glob matches what exists. Missing brace-range members
    are reported by the caller when opened, so one missing shard does not hide the others. As in a shell,
    wildcards stay within one path segment: `laion/*.tar` does not match `laion/old/x.tar`.
    """
    out: list[str] = []
    for item in expand_braces(pattern):
        if not _GLOB_CHARS.search(item):
            out.append(item)
            continue
        if not is_s3(item):
            item = os.path.normpath(item)  # list_files names local files as pathlib does: no `./`, no `//`
        root = _glob_root(item)
        out.extend(info.uri for info in list_files(root) if _glob_match(info.uri, item))
    return sorted(dict.fromkeys(out))


def _glob_match(uri: str, pattern: str) -> bool:
    """fnmatch lets `*` cross `/`; equal segment counts keep every wildcard inside one segment."""
    return uri.count("/") == pattern.count("/") and fnmatch.fnmatchcase(uri, pattern)


def _glob_root(pattern: str) -> str:
    """The longest folder prefix of `pattern` with no glob characters."""
    head = pattern[: _GLOB_CHARS.search(pattern).start()]  # type: ignore[union-attr]
    return head.rsplit("/", 1)[0] if "/" in head else "."


def iter_lines(uri: str) -> Iterator[str]:
    yield from read_bytes(uri).decode().splitlines()
