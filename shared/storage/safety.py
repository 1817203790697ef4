"""Path and credential safety for everything read from stored files, buckets and the environment.

Names that come from stored data (an MDS index's shard basenames, S3 keys, done-markers) decide where we
read and write, fixed folders in the shared temp dir are computable by every user of the machine, and a
password can hide inside S3_ENDPOINT_URL: these helpers refuse the first two and redact the third.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat as stat_module
import tempfile
import urllib.parse
from pathlib import Path

from shared.storage.errors import StorageError

NODE_TMPDIR_ENV = "SD_NODE_TMPDIR"  # the node's temp folder, when a supervisor gave the ranks a scratch one

# `scheme://user:password@host`: the userinfo part of any URL inside a text.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@'\"]+@")
REDACTED = "***"


def redact_url(text: str | None) -> str | None:
    """`text` with the userinfo of every URL in it (and the endpoint's own, even unquoted) replaced by ***.

    A password inside S3_ENDPOINT_URL (`http://user:pass@host`) would otherwise be printed by botocore's
    error text and by our own messages.
    """
    if text is None:
        return None
    out = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    userinfo = urllib.parse.urlsplit(os.environ.get("S3_ENDPOINT_URL") or "").netloc.rpartition("@")[0]
    for secret in {userinfo, userinfo.partition(":")[2], urllib.parse.unquote(userinfo.partition(":")[2])}:
        if len(secret) >= 3:  # a one- or two-character secret would blank out unrelated text
            out = out.replace(secret, REDACTED)
    return out


def unsafe_name_reason(name: object) -> str | None:
    """Why `name` is not a safe relative path inside a folder (None when it is).

    Names read from stored files (an MDS index's shard basenames, S3 keys) decide where we read and write;
    only plain relative paths going down from their folder are accepted.
    """
    if not isinstance(name, str) or not name:
        return "is empty or not a string"
    if "\0" in name:
        return "contains a NUL byte"
    if "\\" in name:
        return "contains a backslash"
    if name.startswith("/") or os.path.isabs(name):
        return "is absolute"
    if any(part in ("..", "") for part in name.split("/")):
        return "has a '..' or empty path segment"
    return None


def contained_path(base: str | Path, name: str, what: str) -> Path:
    """`base/name`, refused (StorageError naming `what`) unless it stays inside `base` (links resolved)."""
    reason = unsafe_name_reason(name)
    base = Path(base).resolve()
    path = (base / name).resolve() if reason is None else base
    if reason is None and not path.is_relative_to(base):
        reason = f"resolves to {path}, outside {base} (through a symlink)"
    if reason is not None:
        raise StorageError(
            f"refusing {what}: its relative path {name!r} {reason}; it must name a file inside {base}"
        )
    return path


def private_temp_dir(name: str, config_key: str) -> Path:
    """`<tmp>/<name>-<uid>`: a folder in the shared temp dir that only this user can write, mode 0700.

    A fixed path in /tmp is computable by every user of the machine; one planted there (a folder owned by
    someone else, writable by others, or a symlink) is refused, naming the path and the config key to set
    instead, never used. Under a supervisor the ranks' own temp folder is a scratch folder removed when the
    launch ends; these folders (a cache, a run's logs) outlive it, in the node's temp folder
    ($SD_NODE_TMPDIR, shared/launch/control.py).
    """
    base = os.environ.get(NODE_TMPDIR_ENV) or tempfile.gettempdir()
    path = Path(base) / f"{name}-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)  # atomic: either we create it (ours, 0700) or we check what is there
    problem = _not_private_reason(path)
    if problem:
        raise StorageError(
            f"refusing to use {path}: it {problem}. Remove it if it is yours, or set {config_key} to a "
            "folder only you can write"
        )
    return path


def _not_private_reason(path: Path) -> str | None:
    info = os.lstat(path)
    if stat_module.S_ISLNK(info.st_mode):
        return "is a symlink"
    if not stat_module.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_uid != os.getuid():
        return f"is owned by uid {info.st_uid}, not this user ({os.getuid()})"
    if info.st_mode & 0o022:
        return f"is writable by group or others (mode {oct(info.st_mode & 0o777)})"
    return None
