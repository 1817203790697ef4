"""The error type of the storage layer, and its outage subtype (its own module so `storage` and
`storage.safety` share it)."""

from __future__ import annotations

from collections.abc import Iterator


class StorageError(OSError):
    """A storage operation failed in a way the user can fix (missing file, bad URI, no credentials), or,
    with `transient`, the way an outage does (no connection, timeouts, 5xx, throttling) after the retries:
    a restart from the last checkpoint may get past it, so it must not stop an unattended run for good."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class StorageOutageError(StorageError):
    """A StorageError with `transient` set, by its type: a DataLoader worker's error reaches the training
    process as its type and message only (torch rebuilds it as `type(message)`), and a plain StorageError
    with `transient` lost there was taken for a setting (exit 2: the supervisor stopped the run)."""

    def __init__(self, message: str):
        super().__init__(message, transient=True)


def causes(err: BaseException, depth: int = 8) -> Iterator[BaseException]:
    """`err`, then the errors it was raised from (at most `depth` in all). `raise ... from None` says what
    it raised replaces the error it was handling: the chain ends there."""
    seen: BaseException | None = err
    for _ in range(depth):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)


def storage_error(message: str, transient: bool) -> StorageError:
    """A StorageError, of the type that says whether it is `transient`."""
    return StorageOutageError(message) if transient else StorageError(message)


OUTAGE_NOT_A_SETTING = "an outage, not a setting"  # how an outage's message ends (shared/storage/outage.py)

# S3 error codes of a server that is there but cannot answer now (botocore's own retryable set, named).
TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
    }
)


def is_missing(err: Exception) -> bool:
    """S3's "no such object"."""
    code = getattr(err, "response", {}).get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound")


def is_transient(err: BaseException) -> bool:
    """An outage rather than a refusal: botocore could not reach or hear the server (connection refused or
    closed, timeouts), or the server answered 5xx / throttled. Wrong credentials, a missing bucket or an
    AccessDenied are not."""
    try:
        from botocore.exceptions import ClientError, HTTPClientError
        from botocore.exceptions import ConnectionError as NoConnection
    except ImportError:  # pragma: no cover - botocore ships with boto3, a dependency
        return False
    # NoConnection: EndpointConnectionError, ConnectTimeoutError; HTTPClientError: closed, read timeouts
    if isinstance(err, NoConnection | HTTPClientError):
        return True
    if isinstance(err, ClientError):
        error = err.response.get("Error", {})
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status >= 500 or error.get("Code", "") in TRANSIENT_CODES
    return False
