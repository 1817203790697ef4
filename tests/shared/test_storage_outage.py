"""Waiting out an S3 outage (shared/storage/outage.py): what counts as one, the backoff, the patience."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError

from shared.storage import StorageError
from shared.storage.outage import LONGEST_WAIT_S, backoff_s, is_outage, wait_out_outages


def client_error(code: str, status: int) -> ClientError:
    response = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "PutObject")  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_what_is_an_outage_and_what_is_a_refusal() -> None:
    from boto3.exceptions import S3UploadFailedError

    assert is_outage(EndpointConnectionError(endpoint_url="http://s3:9000"))
    assert is_outage(ConnectionClosedError(endpoint_url="http://s3:9000"))
    assert is_outage(client_error("SlowDown", 503)) and is_outage(client_error("InternalError", 500))
    # s3transfer folds the server's answer into the text of its own error (Composer's uploads raise it)
    assert is_outage(S3UploadFailedError("An error occurred (ServiceUnavailable) when calling UploadPart"))
    assert is_outage(StorageError("S3 request failed", transient=True))
    try:  # raised from one, as a library's wrapper does
        try:
            raise EndpointConnectionError(endpoint_url="http://s3:9000")
        except EndpointConnectionError as err:
            raise RuntimeError("Background thread failed") from err
    except RuntimeError as wrapped:
        assert is_outage(wrapped)
    for refusal in (
        client_error("AccessDenied", 403),
        client_error("NoSuchBucket", 404),
        StorageError("S3 request failed: InvalidAccessKeyId"),
        FileNotFoundError("s3://b/k does not exist"),
        ValueError("Checksum failure"),
    ):
        assert not is_outage(refusal), refusal


def test_the_backoff_doubles_to_a_minute_with_jitter() -> None:
    assert [backoff_s(n, rng=lambda: 1.0) for n in (1, 2, 3, 4, 5, 6, 7, 12)] == [2, 4, 8, 16, 32, 60, 60, 60]
    assert backoff_s(3, rng=lambda: 0.0) == 4.0  # never under half
    assert backoff_s(40, rng=lambda: 0.99) <= LONGEST_WAIT_S


def test_an_outage_is_waited_out_and_the_recovery_logged(caplog: pytest.LogCaptureFixture) -> None:
    clock, calls = Clock(), []

    def call() -> str:
        calls.append(clock.now)
        if len(calls) < 4:
            raise EndpointConnectionError(endpoint_url="http://s3:9000")
        return "uploaded"

    with caplog.at_level("WARNING"):
        assert wait_out_outages(call, "uploading x", 600, sleep=clock.sleep, clock=clock) == "uploaded"
    assert len(calls) == 4 and 0 < clock.now < 2 + 4 + 8 + 1
    assert "uploading x: S3 is not answering" in caplog.text and "answered again after" in caplog.text


def test_past_the_patience_the_outage_is_a_transient_error_naming_the_setting() -> None:
    clock = Clock()

    def call() -> None:
        raise EndpointConnectionError(endpoint_url="http://user:secret@s3:9000")

    with pytest.raises(StorageError) as raised:
        wait_out_outages(call, "uploading x", 100, sleep=clock.sleep, clock=clock)
    assert raised.value.transient
    text = str(raised.value)
    assert "uploading x: S3 did not answer for 100 s (the wait, resilience.outage_patience_s: 100 s" in text
    assert "secret" not in text  # an endpoint's credentials are redacted
    assert clock.now == 100  # the last wait is cut to the patience left


def test_a_refusal_is_raised_at_once() -> None:
    clock = Clock()

    def call() -> None:
        raise client_error("AccessDenied", 403)

    with pytest.raises(ClientError):
        wait_out_outages(call, "uploading x", 600, sleep=clock.sleep, clock=clock)
    assert clock.slept == []


def test_an_error_raised_from_none_over_an_outage_is_not_one() -> None:
    """`raise Stop(...) from None` replaces the outage it handled (the start-up wait's resumable stop): taken
    for an outage, it was recorded as one and its exit 0 then read as a finished run."""
    try:
        try:
            raise EndpointConnectionError(endpoint_url="http://s3:9000")
        except EndpointConnectionError:
            raise RuntimeError("stopping: rerun later") from None
    except RuntimeError as replaced:
        assert not is_outage(replaced)
