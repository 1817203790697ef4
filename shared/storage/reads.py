"""S3 GETs that survive a response body that breaks while it is read.

botocore retries a request whose response fails before its body (5xx, throttling, a reset connection), but
not a body that breaks while the caller reads it: a connection cut mid-object (IncompleteReadError,
ResponseStreamingError, ReadTimeoutError, a urllib3 ProtocolError) or a body that fails the checksum the
server sent with it (FlexibleChecksumError: a SeaweedFS server on a loaded 2-core machine was seen sending
an object's CRC32 header with an empty body). Those reach the caller as an exception halfway through a
source shard or an index. Here:
- whole-object reads are retried from the start;
- streams re-request the rest of the object with a Range from the byte they had handed out, pinned to the
  first response's ETag (`IfMatch`), so an object replaced meanwhile is refused, never spliced. A checksum
  failure is only retried while nothing was handed out: after that the caller already holds bytes the
  checksum disowns.
"""

from __future__ import annotations

import io
import logging
import time
from typing import Any

from shared.storage.errors import StorageError

log = logging.getLogger(__name__)

BODY_ATTEMPTS = 4  # reads of one object (or of one stream position) before the error is the caller's
_BACKOFF_S = 0.2  # doubled every attempt


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


def get_bytes(client: Any, bucket: str, key: str) -> bytes:
    """The whole object, its GET repeated when the body breaks (botocore's errors before the body are
    the caller's)."""
    transient = transient_body_errors()
    for attempt in range(BODY_ATTEMPTS):
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        try:
            return body.read()
        except transient as err:
            if attempt == BODY_ATTEMPTS - 1:
                raise
            log.warning("s3://%s/%s: the response body broke (%s); reading it again", bucket, key, err)
            _pause(attempt)
        finally:
            body.close()
    raise AssertionError("unreachable")


class ResumingBody(io.RawIOBase):
    """A read-only stream of one S3 object that resumes with a Range request where its body broke."""

    def __init__(self, client: Any, bucket: str, key: str):
        super().__init__()
        self._client, self._bucket, self._key = client, bucket, key
        response = client.get_object(Bucket=bucket, Key=key)
        self._etag = response.get("ETag")
        self._body = response["Body"]
        self._offset = 0  # bytes handed to the caller
        self._transient = transient_body_errors()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        for attempt in range(BODY_ATTEMPTS):
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
        if attempt == BODY_ATTEMPTS - 1 or (_checksum_error(err) and self._offset):
            raise StorageError(
                f"reading {where} failed at byte {self._offset} after {attempt + 1} attempt(s): {err}; "
                "check the S3 server's health (S3_ENDPOINT_URL) and rerun"
            ) from err
        log.warning("%s: the response body broke at byte %d (%s); resuming there", where, self._offset, err)
        self._body.close()
        _pause(attempt)
        extra: dict[str, Any] = {"Range": f"bytes={self._offset}-"} if self._offset else {}
        if self._etag:
            extra["IfMatch"] = self._etag  # a replaced object fails with 412 instead of being spliced
        try:
            self._body = self._client.get_object(Bucket=self._bucket, Key=self._key, **extra)["Body"]
        except Exception as again:
            if "PreconditionFailed" in str(again) or "412" in str(again):
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
