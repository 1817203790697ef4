"""S3 calls that survive a transfer that breaks: every GET, PUT, HEAD and file transfer of shared.storage.

botocore retries a request whose response fails before its body (5xx, throttling, a reset connection), but
not:
- a body that breaks while the caller reads it: a connection cut mid-object (IncompleteReadError,
  ResponseStreamingError, ReadTimeoutError, a urllib3 ProtocolError) or a body that fails the checksum the
  server sent with it (FlexibleChecksumError);
- a request the server says arrived damaged (BadDigest: the body's checksum did not match; AWS documents it
  as corruption in transit, to be retried), or a response that belongs to no request of ours.
A SeaweedFS server on a loaded 2-core machine did all of these: its log showed a PUT body whose CRC32 did
not match the client's trailer, and the same connection then answered a GET with that PUT's reply (an
empty body with a checksum header: "calculated checksum: AAAAAA==", or BadDigest on a GetObject) and a
HEAD with 400. They reached the caller halfway through a source shard or an index. Here:
- whole-object reads, file transfers, puts and heads are repeated (`retried`, at most ATTEMPTS times, with
  backoff; anything else is raised at once);
- streams re-request the rest of the object with a Range from the byte they had handed out, pinned to the
  ETag of the response those bytes came from (`IfMatch`), so an object replaced meanwhile is refused, never
  spliced. A checksum failure is only retried while nothing was handed out: after that the caller already
  holds bytes the checksum disowns.
"""

from __future__ import annotations

import io
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from shared.storage.errors import StorageError

log = logging.getLogger(__name__)

T = TypeVar("T")
# botocore's attempts per request of our client, and (AWS_MAX_ATTEMPTS) of the clients the libraries build.
BOTOCORE_ATTEMPTS = 8
MAX_ATTEMPTS_ENV = "AWS_MAX_ATTEMPTS"
ATTEMPTS = 4  # tries of one call (or of one stream position) before the error is the caller's
_BACKOFF_S = 0.2  # doubled every attempt
# Error codes of a request or response damaged in transit ("400": a HEAD's error has no body to name it).
TRANSIENT_CODES = frozenset({"BadDigest", "XAmzContentSHA256Mismatch", "RequestTimeout", "400"})
_CODE_IN_MESSAGE = re.compile(r"An error occurred \((\w+)\)")  # s3transfer re-raises ClientErrors as text


def transient_body_errors() -> tuple[type[BaseException], ...]:
    """What a broken response body raises while it is read (botocore 1.36+, urllib3 2)."""
    from botocore.exceptions import (
        ConnectionClosedError,
        FlexibleChecksumError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )
    from urllib3.exceptions import ProtocolError

    return (
        ConnectionClosedError,
        FlexibleChecksumError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
        ProtocolError,
    )


def _checksum_error(err: BaseException) -> bool:
    from botocore.exceptions import FlexibleChecksumError

    return isinstance(err, FlexibleChecksumError)


def _pause(attempt: int) -> None:
    time.sleep(_BACKOFF_S * (1 << attempt))


def error_code(err: BaseException) -> str:
    """The S3 error code of a botocore ClientError, or of the text s3transfer wrapped one in ('' if none)."""
    code = getattr(err, "response", {}).get("Error", {}).get("Code")
    if code:
        return str(code)
    match = _CODE_IN_MESSAGE.search(str(err))
    return match.group(1) if match else ""


def is_transient(err: BaseException) -> bool:
    return isinstance(err, transient_body_errors()) or error_code(err) in TRANSIENT_CODES


def retried(call: Callable[[], T], what: str, client: Any) -> T:
    """`call()`, repeated while it fails in transit (see module doc); other errors are raised at once."""
    for attempt in range(ATTEMPTS):
        try:
            return call()
        except Exception as err:
            if attempt == ATTEMPTS - 1 or not is_transient(err):
                raise
            log.warning("%s failed in transit (%s); trying again (%d/%d)", what, err, attempt + 2, ATTEMPTS)
            drop_pooled_connections(client)
            _pause(attempt)
    raise AssertionError("unreachable")


def drop_pooled_connections(client: Any) -> None:
    """Close the client's idle keep-alive connections (in-flight ones are not reused after they finish).

    A connection that delivered a reply to the wrong request answers every later request on it with the
    reply of the one before: an object's body with its own ETag and checksum, which nothing could tell from
    the right one. After a failure in transit no pooled connection is trusted (botocore's URLLib3Session).
    """
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    if session is not None:
        session.close()


def get_bytes(client: Any, bucket: str, key: str) -> bytes:
    """The whole object; the GET is repeated when it or its body fails in transit."""

    def read() -> bytes:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        try:
            return body.read()
        finally:
            body.close()

    return retried(read, f"reading s3://{bucket}/{key}", client)


def download_file(client: Any, bucket: str, key: str, dest: str) -> None:
    """s3transfer's download (parallel ranged GETs, written to a temp file renamed into place, so a failed
    attempt leaves nothing at `dest`), repeated when it fails in a way s3transfer does not retry itself."""
    retried(lambda: client.download_file(bucket, key, dest), f"downloading s3://{bucket}/{key}", client)


def upload_file(client: Any, path: str, bucket: str, key: str) -> None:
    """s3transfer's upload, repeated when the server says the body arrived damaged (BadDigest)."""
    retried(lambda: client.upload_file(path, bucket, key), f"uploading {path} to s3://{bucket}/{key}", client)


class ResumingBody(io.RawIOBase):
    """A read-only stream of one S3 object that resumes with a Range request where its body broke."""

    def __init__(self, client: Any, bucket: str, key: str):
        super().__init__()
        self._client, self._bucket, self._key = client, bucket, key
        get = lambda: client.get_object(Bucket=bucket, Key=key)  # noqa: E731
        response = retried(get, f"reading s3://{bucket}/{key}", client)
        self._etag = response.get("ETag")
        self._body = response["Body"]
        self._offset = 0  # bytes handed to the caller
        self._transient = transient_body_errors()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        for attempt in range(ATTEMPTS):
            try:
                data = self._body.read(len(view))
            except self._transient as err:
                self._resume_after(err, attempt)
                continue
            view[: len(data)] = data
            self._offset += len(data)
            return len(data)
        raise AssertionError("unreachable")

    def _resume_after(self, err: BaseException, attempt: int) -> None:
        where = f"s3://{self._bucket}/{self._key}"
        if attempt == ATTEMPTS - 1 or (_checksum_error(err) and self._offset):
            raise StorageError(
                f"reading {where} failed at byte {self._offset} after {attempt + 1} attempt(s): {err}; "
                "check the S3 server's health (S3_ENDPOINT_URL) and rerun"
            ) from err
        log.warning("%s: the response body broke at byte %d (%s); resuming there", where, self._offset, err)
        self._body.close()
        drop_pooled_connections(self._client)
        _pause(attempt)
        if not self._offset:
            # Nothing handed out yet: a fresh read, whose ETag is the one to pin. The broken response's ETag
            # may not be the object's (a reply that belonged to another request: see the module doc).
            get = lambda: self._client.get_object(Bucket=self._bucket, Key=self._key)  # noqa: E731
            response = retried(get, where, self._client)
            self._etag, self._body = response.get("ETag"), response["Body"]
            return
        extra: dict[str, Any] = {"Range": f"bytes={self._offset}-"}
        if self._etag:
            extra["IfMatch"] = self._etag  # a replaced object fails with 412 instead of being spliced
        try:
            get = lambda: self._client.get_object(Bucket=self._bucket, Key=self._key, **extra)  # noqa: E731
            self._body = retried(get, where, self._client)["Body"]
        except Exception as again:
            if error_code(again) in ("PreconditionFailed", "412"):
                raise StorageError(
                    f"{where} was replaced while it was being read (its ETag changed at byte "
                    f"{self._offset}); rerun once writers of it have finished"
                ) from None
            raise

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


def open_resuming(client: Any, bucket: str, key: str, buffer_size: int = 1 << 20) -> io.BufferedReader:
    """A buffered binary stream over `ResumingBody` (the caller closes it)."""
    return io.BufferedReader(ResumingBody(client, bucket, key), buffer_size=buffer_size)


def libraries_retry_like_us() -> None:
    """Composer's checkpoint uploader and Streaming's shard transfers build boto3 clients of their own, which
    give up after 3 attempts (Composer asks for botocore's adaptive mode, 3 attempts by default): one
    InternalError from a loaded SeaweedFS on an UploadPart failed a two-node run's checkpoint upload, and
    that rank's node then waited for a rendezvous its peer had left. botocore reads AWS_MAX_ATTEMPTS for a
    client whose config names no count: the same attempts as our own client, unless the environment says
    otherwise. Call before the libraries start their upload processes (they inherit the environment)."""
    os.environ.setdefault(MAX_ATTEMPTS_ENV, str(BOTOCORE_ATTEMPTS))
