"""shared/storage.py against hostile names, planted temp folders and credentials in the endpoint URL."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from shared import storage

SECRET_ENDPOINT_USER, SECRET_ENDPOINT_PASSWORD = "alice", "hunter2-sekrit"


# ------------------------------------------------------------------------------------- names and keys
@pytest.mark.parametrize(
    "name",
    ["../x/shard.mds", "a/../../x", "/etc/passwd", "a\\..\\b", "a\0b", "", "a//b", "./../x", ".."],
)
def test_unsafe_relative_names_are_named(name: str) -> None:
    assert storage.unsafe_name_reason(name) is not None


@pytest.mark.parametrize("name", ["shard.00000.mds", "part00001-abcd/shard.00000.mds.zstd", "a.b/c"])
def test_plain_relative_names_pass(name: str) -> None:
    assert storage.unsafe_name_reason(name) is None


def test_contained_path_refuses_a_symlink_out_of_the_folder(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "link").symlink_to(tmp_path)
    with pytest.raises(storage.StorageError, match="outside"):
        storage.contained_path(tmp_path / "base", "link/victim", "key k")


@pytest.mark.parametrize(
    ("hostile_key", "reason"),
    [("p/../../escaped.txt", r"'\.\.' or empty"), ("p/{target}", "is absolute")],
)
def test_download_dir_refuses_keys_that_leave_the_destination(
    hostile_key: str, reason: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys come from a listing of someone's bucket (SeaweedFS itself refuses `..` keys, AWS does not):
    `s3://b/p//x` lists as the relative name `/x`, which joined naively is the absolute path itself."""
    target = tmp_path / "victim.txt"
    listed = [
        storage.FileInfo("s3://b/p/ok.txt", 4, "e1"),
        storage.FileInfo("s3://b/" + hostile_key.format(target=target), 4, "e2"),
    ]
    monkeypatch.setattr(storage, "list_files", lambda prefix: listed)
    monkeypatch.setattr(storage, "s3_client", lambda: pytest.fail("nothing may be downloaded"))
    dest = tmp_path / "deep" / "dest"
    with pytest.raises(storage.StorageError, match=rf"{reason}.*inside {dest}"):
        storage.download_dir("s3://b/p", dest)
    assert not target.exists() and not dest.exists()


# ------------------------------------------------------------------------------ private temp folders
@pytest.fixture
def own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(storage.tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


def test_private_temp_dir_is_per_user_and_0700(own_tmp: Path) -> None:
    path = storage.private_temp_dir("sd-x", "data.cache_dir")
    assert path == own_tmp / f"sd-x-{os.getuid()}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert storage.private_temp_dir("sd-x", "data.cache_dir") == path  # reuse is fine


def test_a_planted_symlink_is_refused(own_tmp: Path) -> None:
    (own_tmp / "elsewhere").mkdir(mode=0o700)
    (own_tmp / f"sd-x-{os.getuid()}").symlink_to(own_tmp / "elsewhere")
    with pytest.raises(storage.StorageError, match=r"symlink.*data\.cache_dir"):
        storage.private_temp_dir("sd-x", "data.cache_dir")


def test_a_world_writable_folder_is_refused(own_tmp: Path) -> None:
    planted = own_tmp / f"sd-x-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(storage.StorageError, match=rf"{planted}.*writable.*log\.local_dir"):
        storage.private_temp_dir("sd-x", "log.local_dir")


def test_a_folder_owned_by_someone_else_is_refused(own_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = own_tmp / f"sd-x-{os.getuid()}"
    planted.mkdir(mode=0o700)
    real_lstat = os.lstat

    def other_owner(path: object) -> os.stat_result:  # no second user on a CI box: fake the owner
        info = list(real_lstat(path))
        info[stat.ST_UID] = os.getuid() + 1
        return os.stat_result(info)

    monkeypatch.setattr(storage.os, "lstat", other_owner)
    with pytest.raises(storage.StorageError, match=r"owned by uid"):
        storage.private_temp_dir("sd-x", "data.cache_dir")


# ---------------------------------------------------------------------------------------- credentials
def closed_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed when this returns: connecting is refused


def test_endpoint_password_never_appears_in_s3_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"http://{SECRET_ENDPOINT_USER}:{SECRET_ENDPOINT_PASSWORD}@127.0.0.1:{closed_loopback_port()}"
    monkeypatch.setenv("S3_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setattr(storage, "_client", storage._client.__wrapped__)  # no cached client, no retries
    monkeypatch.setattr(storage, "s3_client", lambda: _no_retry_client(endpoint))
    with pytest.raises(storage.StorageError) as caught:
        storage.read_bytes("s3://bucket/key")
    shown = "".join(_exception_chain_text(caught.value))
    assert "127.0.0.1" in shown and storage.REDACTED in shown
    assert SECRET_ENDPOINT_PASSWORD not in shown and SECRET_ENDPOINT_USER not in shown


def _no_retry_client(endpoint: str) -> object:
    import boto3
    from botocore.config import Config

    config = Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=1)
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


def _exception_chain_text(err: BaseException | None) -> list[str]:
    """What a traceback would print: every message in the __cause__ / __context__ chain."""
    out = []
    while err is not None:
        out.append(str(err))
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return out


def test_redact_url_hides_userinfo_anywhere_in_a_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S3_ENDPOINT_URL", f"https://u:{SECRET_ENDPOINT_PASSWORD}@s3.example")
    password = SECRET_ENDPOINT_PASSWORD
    text = f'Could not connect to "https://u:{password}@s3.example/b/k" ({password})'
    assert storage.redact_url(text) == 'Could not connect to "https://***@s3.example/b/k" (***)'
