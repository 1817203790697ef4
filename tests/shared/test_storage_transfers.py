"""shared/storage/transfers.py against the real S3 server: a response body that breaks while it is read.

The server is real (SeaweedFS on loopback); the break is injected into the first response of a GET by
wrapping its body, the way a cut connection or an empty body with a checksum header reaches botocore's
caller. Every retry goes to the server.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import FlexibleChecksumError, ResponseStreamingError

from shared import storage

pytestmark = pytest.mark.s3

SIZE = 3 << 20
CHUNK = 256 << 10


class BreakingBody:
    """A botocore body that hands out `good` bytes, then raises `error` (a real body's API subset)."""

    def __init__(self, body: Any, good: int, error: BaseException):
        self.body, self.left, self.error = body, good, error

    def read(self, amt: int | None = None) -> bytes:
        if self.left <= 0 or amt is None:  # read(): the whole body, so it meets the break
            raise self.error
        data = self.body.read(min(amt, self.left))
        self.left -= len(data)
        return data

    def close(self) -> None:
        self.body.close()


def break_first_gets(
    monkeypatch: pytest.MonkeyPatch, good: int, error: BaseException, times: int = 1, etag: str | None = None
) -> list:
    """The next `times` GetObject responses break after `good` bytes; returns the GETs' arguments."""
    client = storage.s3_client()
    real = client.get_object
    calls: list[dict[str, Any]] = []

    def get_object(**kwargs: Any) -> dict[str, Any]:
        response = real(**kwargs)
        calls.append(kwargs)
        if len(calls) <= times:
            response["Body"] = BreakingBody(response["Body"], good, error)
            response["ETag"] = etag or response.get("ETag")
        return response

    monkeypatch.setattr(client, "get_object", get_object)
    return calls


def cut() -> ResponseStreamingError:
    return ResponseStreamingError(error="Connection broken: IncompleteRead")


def empty_body_checksum() -> FlexibleChecksumError:
    return FlexibleChecksumError(error_msg="Expected checksum x did not match calculated checksum: AAAAAA==")


@pytest.fixture
def obj(s3_prefix: str) -> tuple[str, bytes]:
    data = os.urandom(SIZE)
    uri = storage.join(s3_prefix, "obj.bin")
    storage.write_bytes(uri, data)
    return uri, data


@pytest.mark.parametrize("error", [cut, empty_body_checksum])
def test_read_bytes_reads_a_broken_body_again(
    obj: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch, error: Any
) -> None:
    uri, data = obj
    calls = break_first_gets(
        monkeypatch, good=0 if error is empty_body_checksum else SIZE // 2, error=error()
    )
    assert storage.read_bytes(uri) == data
    assert len(calls) == 2


def test_a_stream_resumes_where_its_body_was_cut(
    obj: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, data = obj
    calls = break_first_gets(monkeypatch, good=SIZE // 3, error=cut(), times=2)
    with storage.open_read(uri) as stream:
        chunks = list(iter(lambda: stream.read(CHUNK), b""))
    assert b"".join(chunks) == data
    assert len(calls) == 3 and calls[1]["Range"] == f"bytes={SIZE // 3}-" and calls[1]["IfMatch"]
    assert calls[2]["Range"] == f"bytes={2 * (SIZE // 3)}-"


def test_a_stream_retries_an_empty_body_that_failed_its_checksum(
    obj: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen from SeaweedFS right after the object was written: an empty body with another object's ETag.
    Nothing was handed out, so the retry is a fresh read (not pinned to that ETag)."""
    uri, data = obj
    break_first_gets(
        monkeypatch, good=0, error=empty_body_checksum(), etag='"d41d8cd98f00b204e9800998ecf8427e"'
    )
    with storage.open_read(uri) as stream:
        assert stream.read() == data


def test_a_checksum_failure_after_bytes_were_handed_out_is_an_error(
    obj: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, _ = obj
    break_first_gets(monkeypatch, good=SIZE // 2, error=empty_body_checksum())
    with storage.open_read(uri) as stream, pytest.raises(storage.StorageError, match="failed at byte"):
        stream.read()


def test_an_object_replaced_mid_read_is_refused_not_spliced(
    obj: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, _ = obj
    break_first_gets(monkeypatch, good=SIZE // 2, error=cut())
    with storage.open_read(uri) as stream:
        head = stream.read(CHUNK)
        storage.write_bytes(uri, os.urandom(SIZE))  # a writer replaces it before the body breaks
        with pytest.raises(storage.StorageError, match="replaced while it was being read"):
            stream.read()
    assert len(head) == CHUNK


def test_a_body_that_keeps_breaking_fails_with_the_attempts(
    obj: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, _ = obj
    break_first_gets(monkeypatch, good=0, error=cut(), times=100)  # no progress at all
    with storage.open_read(uri) as stream, pytest.raises(storage.StorageError, match="4 attempt"):
        stream.read()


def test_a_download_is_repeated_when_its_body_fails_its_checksum(
    obj: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """s3transfer resumes cut connections itself but passes a checksum failure on (seen on index.json)."""
    uri, data = obj
    calls = break_first_gets(monkeypatch, good=0, error=empty_body_checksum())
    storage.download(uri, tmp_path / "obj.bin")
    assert (tmp_path / "obj.bin").read_bytes() == data
    assert len(calls) == 2


def test_a_missing_download_names_the_uri(s3_prefix: str, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.bin does not exist"):
        storage.download(storage.join(s3_prefix, "missing.bin"), tmp_path / "x")


def fail_first_calls(
    monkeypatch: pytest.MonkeyPatch, method: str, error: BaseException, times: int = 1
) -> list:
    """The client's next `times` calls of `method` raise `error` without reaching the server."""
    client = storage.s3_client()
    real = getattr(client, method)
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(client, method, failing)
    return calls


def client_error(code: str, operation: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "injected"}}, operation)


def test_an_upload_the_server_received_damaged_is_repeated(
    s3_prefix: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """s3transfer re-raises BadDigest as text (S3UploadFailedError): the code is read from the message."""
    from boto3.exceptions import S3UploadFailedError

    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "index.json").write_bytes(b"{}")
    damaged = S3UploadFailedError(
        "Failed to upload x: An error occurred (BadDigest) when calling the PutObject operation: injected"
    )
    calls = fail_first_calls(monkeypatch, "upload_file", damaged)
    storage.upload_dir(tmp_path / "up", storage.join(s3_prefix, "up"))
    assert storage.read_bytes(storage.join(s3_prefix, "up", "index.json")) == b"{}" and len(calls) == 2


def test_answers_from_a_desynchronised_connection_are_retried(
    obj: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GET answered with a PUT's BadDigest, a HEAD with a bare 400 (seen from SeaweedFS after a damaged
    PUT on the same connection)."""
    uri, data = obj
    session = storage.s3_client()._endpoint.http_session
    real_close, closed = session.close, []
    monkeypatch.setattr(session, "close", lambda: closed.append(1) or real_close())
    fail_first_calls(monkeypatch, "get_object", client_error("BadDigest", "GetObject"))
    assert storage.read_bytes(uri) == data
    fail_first_calls(monkeypatch, "head_object", client_error("400", "HeadObject"))
    assert storage.stat(uri).size == SIZE
    assert len(closed) == 2  # no pooled connection is reused after a reply that may not be ours


def test_errors_that_are_not_transient_are_raised_at_once(
    obj: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, _ = obj
    calls = fail_first_calls(monkeypatch, "get_object", client_error("AccessDenied", "GetObject"), times=9)
    with pytest.raises(storage.StorageError, match="AccessDenied"):
        storage.read_bytes(uri)
    assert len(calls) == 1
