"""Leases: a training job's claim on the dataset version it streams, so `encode gc` keeps that version.

A lease is one small JSON object next to the data, `<dataset root>/_leases/<lease name>.json`, holding the
version, the job (run name), host, pid and when it was written and expires (unix seconds). The job writes
it when it starts, rewrites it every LEASE_REFRESH_S while it runs and deletes it when it ends cleanly; a
job that dies stops refreshing, and its lease expires LEASE_TTL_S after the last write, so a crash never
pins a version forever; `encode gc` removes leases lapsed for another LEASE_TTL_S. A lease is named by job and
host, so a restart rewrites its own. Works for local folders and s3:// through shared/storage.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from shared import storage

log = logging.getLogger(__name__)

LEASES_DIRNAME = "_leases"
# A running job rewrites its lease this often; a lease not rewritten for LEASE_TTL_S has expired. The
# TTL is 6 refresh periods: a few slow or failed writes (an S3 hiccup) never let a live job's lease lapse.
LEASE_REFRESH_S = 5 * 60
LEASE_TTL_S = 30 * 60
# Lease file names become S3 keys and local file names: plain characters only, no path separators.
LEASE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,159}")
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]+")


class LeaseError(ValueError):
    """A lease name or file that cannot be used; the message names it."""


@dataclass(frozen=True)
class Lease:
    version: str  # the dataset version the job streams
    job: str  # the run name
    host: str
    pid: int
    written: float  # unix seconds
    expires: float  # unix seconds

    def is_live(self, now: float) -> bool:
        return self.expires > now

    def describe(self, now: float) -> str:
        minutes = max(0.0, (self.expires - now) / 60)
        return f"job {self.job} (host {self.host}, pid {self.pid}, lease expires in {minutes:.0f} min)"

    @classmethod
    def from_json(cls, obj: object) -> Lease:
        if not isinstance(obj, dict):
            raise LeaseError("a lease is not a JSON object")
        try:
            return cls(
                version=str(obj["version"]),
                job=str(obj["job"]),
                host=str(obj["host"]),
                pid=int(obj["pid"]),
                written=float(obj["written"]),
                expires=float(obj["expires"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise LeaseError(f"a lease lacks or mistypes a field ({err})") from err


def lease_name(job: str, host: str | None = None) -> str:
    """A file-safe lease name per job and host, `<job>-<host>` with other characters replaced: a restart of
    the job on the host rewrites its lease (named by pid, each of 21 restarts left one more file, forever)."""
    host = host or socket.gethostname()
    name = _UNSAFE_NAME_CHARS.sub("_", f"{job}-{host}").strip("_-")[:160] or "job"
    return check_lease_name(name)


def check_lease_name(name: str) -> str:
    if not LEASE_NAME.fullmatch(name):
        raise LeaseError(f"lease name {name!r} is not a plain file name ([A-Za-z0-9_-], at most 160)")
    return name


def leases_dir(root: str) -> str:
    return storage.join(root, LEASES_DIRNAME)


def lease_uri(root: str, name: str) -> str:
    return storage.join(leases_dir(root), f"{check_lease_name(name)}.json")


def write_lease(
    root: str, name: str, version: str, job: str, ttl_s: float = LEASE_TTL_S, now: float | None = None
) -> Lease:
    """Write (or refresh) this process's lease on `version` of the dataset at `root`."""
    now = time.time() if now is None else now
    lease = Lease(version, job, socket.gethostname(), os.getpid(), now, now + ttl_s)
    storage.write_json(lease_uri(root, name), asdict(lease))
    return lease


def remove_lease(root: str, name: str) -> None:
    storage.delete(lease_uri(root, name))


def list_leases(root: str, with_uris: bool = False) -> tuple[list[Any], dict[str, str]]:
    """Every lease under `root` (expired ones too; `with_uris`: as (uri, lease)), and the files that are not
    leases (uri -> reason)."""
    leases: list[Any] = []
    unreadable = {}
    for info in storage.list_files(leases_dir(root)):
        name = info.uri.rsplit("/", 1)[-1]
        if not name.endswith(".json") or not LEASE_NAME.fullmatch(name.removesuffix(".json")):
            unreadable[info.uri] = "not a lease file name"
            continue
        try:
            lease = Lease.from_json(storage.read_json(info.uri))
            leases.append((info.uri, lease) if with_uris else lease)
        except FileNotFoundError:
            continue  # removed by its job since the listing
        except (LeaseError, json.JSONDecodeError, UnicodeDecodeError) as err:
            unreadable[info.uri] = str(err)
    return leases, unreadable


def live_leases(root: str, now: float | None = None, remove_lapsed: bool = False) -> dict[str, list[Lease]]:
    """version -> its unexpired leases. `remove_lapsed`: delete leases expired for another LEASE_TTL_S (their
    jobs died or stopped an hour ago; a job that resumes writes a new one at its start)."""
    now = time.time() if now is None else now
    leases, unreadable = list_leases(root, with_uris=True)
    for uri, reason in unreadable.items():
        log.warning("ignoring %s: %s", uri, reason)
    out: dict[str, list[Lease]] = {}
    for uri, lease in leases:
        if lease.is_live(now):
            out.setdefault(lease.version, []).append(lease)
        elif remove_lapsed and now > lease.expires + LEASE_TTL_S:
            storage.delete(uri)
    return out
