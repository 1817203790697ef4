"""What encode accepts back from its own output folder: ids, folder names, shard entries, containment.

Done-markers, partition indexes and version folders are read back by the next run, `finalize` and `gc`,
and anyone who can write the output bucket can plant them. Every name read from them is checked against
the strict form encode itself writes before it becomes part of a path, and `gc` deletes only URIs it
listed that lie inside the dataset root.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

from shared import contract, storage

# encode/sources/listing.py makes partition ids from [A-Za-z0-9_-] (plus hash suffixes), at most ~131 chars.
PARTITION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,199}")
# shared.manifest.fingerprint: 16 hex digits.
RECIPE_ID = re.compile(r"[0-9a-f]{16}")
# encode/plan/fingerprints.py output_dirname: "<partition id>-<12 hex digits of the output fingerprint>".
OUTPUT_DIR = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,199}-[0-9a-f]{12}")
# encode/publish/finalize.py version ids: "<UTC timestamp>-<8 hex digits of the dataset fingerprint>".
VERSION_ID = re.compile(r"[0-9]{8}T[0-9]{12}Z-[0-9a-f]{8}")
# What MDSWriter names shard files (`shard.00000.mds`, `shard.00000.mds.zstd`): one plain file name.
SHARD_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,200}")
SHARD_FILE_PARTS = ("raw_data", "zip_data")


class UnsafeOutputError(ValueError):
    """A stored output (index, done-marker) encode did not write this way; the message names the file."""


def is_partition_id(value: Any) -> bool:
    return isinstance(value, str) and PARTITION_ID.fullmatch(value) is not None


def is_recipe_id(value: Any) -> bool:
    return isinstance(value, str) and RECIPE_ID.fullmatch(value) is not None


def is_output_dir(value: Any, partition: str | None = None) -> bool:
    """A partition output folder name (of `partition`, when given)."""
    if not isinstance(value, str) or OUTPUT_DIR.fullmatch(value) is None:
        return False
    return partition is None or value.rsplit("-", 1)[0] == partition


def is_version_id(value: Any) -> bool:
    return isinstance(value, str) and VERSION_ID.fullmatch(value) is not None


def is_shard_file_name(value: Any) -> bool:
    return isinstance(value, str) and SHARD_FILE_NAME.fullmatch(value) is not None and ".." not in value


def check_shard_entry(info: Any, where: str, shapes: contract.Shapes | None = None) -> None:
    """Refuse an MDS index entry that is not a contract shard, before any of its rows is read.

    An undeclared column encoding such as `pkl` would run code when a row is decoded; a file name with a
    `/` would read or write outside the folder.
    """
    if not isinstance(info, dict) or info.get("format") != "mds":
        raise UnsafeOutputError(f"{where}: a shard entry is not an MDS shard: {str(info)[:200]}")
    names, encodings = info.get("column_names"), info.get("column_encodings")
    if not isinstance(names, list) or not isinstance(encodings, list):
        raise UnsafeOutputError(f"{where}: a shard entry has no column names / encodings")
    bad = contract.undeclared_columns([str(n) for n in names], [str(e) for e in encodings], shapes)
    if bad:
        raise UnsafeOutputError(
            f"{where} declares columns the data contract does not (shared/contract.py): {', '.join(bad)}; "
            "delete that folder or done-marker (its partition is encoded again from the source)"
        )
    for part in SHARD_FILE_PARTS:
        entry = info.get(part)
        if entry is None and part == "zip_data":  # uncompressed shards have none
            continue
        name = entry.get("basename") if isinstance(entry, dict) else None
        if not is_shard_file_name(name):
            raise UnsafeOutputError(f"{where}: shard file name {name!r} is not a plain file name")


def is_inside(root: str, uri: str) -> bool:
    """Whether `uri` lies strictly below `root` (local: after resolving links; s3: by key, no `..`)."""
    if storage.is_s3(root) != storage.is_s3(uri):
        return False
    if storage.is_s3(root):
        prefix = root.rstrip("/") + "/"
        if not uri.startswith(prefix):
            return False
        rest = uri[len(prefix) :]
        return bool(rest) and all(seg not in ("", ".", "..") for seg in rest.rstrip("/").split("/"))
    base = os.path.realpath(root)
    target = os.path.realpath(uri)
    return target != base and os.path.commonpath([base, target]) == base


def marker_location(uri: str) -> tuple[str, str]:
    """(partition id, recipe) from where a done-marker was found: `.../_parts/<partition>/<recipe>.json`."""
    folder, name = posixpath.split(uri.replace(os.sep, "/"))
    return posixpath.basename(folder), name.removesuffix(".json")
