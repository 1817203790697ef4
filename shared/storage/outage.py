"""Waiting out an S3 outage: a call repeated while it fails the way an outage does, with backoff, until a
patience runs out.

botocore and `transfers.retried` repeat a failed request for seconds (8 attempts, backoff capped at 20 s),
which carries a dropped connection or one 503, not an outage: a 60 s outage of the S3 server (a proxy that
refused connections, in front of SeaweedFS) during a checkpoint upload failed the upload after ~30 s, the
upload's error stopped the tiny run at its next step under 360 lines of traceback, and the restart began
from scratch (the checkpoint never reached S3) while the supervisor said it resumed from that checkpoint.
Here a call is repeated for as long as the caller can afford to wait (resilience.outage_patience_s for a
checkpoint upload in the background and for a run's start; less for a shard a step is waiting on), and
only an error that still looks like an outage after that reaches the caller, as a transient StorageError.
Refusals (AccessDenied, a missing bucket or object, bad credentials) are raised at once, as before.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from shared.storage.errors import (
    OUTAGE_NOT_A_SETTING,
    StorageError,
    StorageOutageError,
    causes,
    is_transient,
)
from shared.storage.safety import redact_url
from shared.storage.transfers import error_code
from shared.storage.transfers import is_transient as is_transient_in_transit

log = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_WAIT_S = 2.0  # doubled after every failed try ...
LONGEST_WAIT_S = 60.0  # ... up to this: an outage of minutes is seen within a minute of its end
# Waits are drawn between half and all of the backoff: 256 ranks that lost S3 together do not come back
# with their requests in step (AWS's "full jitter" advice, halved so the wait still grows).
JITTER_LOW = 0.5
# S3 error codes s3transfer folds into the text of its S3UploadFailedError / a re-raised ClientError.
_OUTAGE_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown", "503", "500", "502", "504"})
PROBE_TIMEOUT_S = 10.0  # a HEAD answers in milliseconds; a black-holed endpoint fails within this


def is_outage(err: BaseException) -> bool:
    """Whether `err`, or an error it was raised from, is S3 failing the way an outage does: no connection,
    a connection closed or timed out, 5xx, throttling (StorageError(transient=True) included)."""
    for seen in causes(err):
        if isinstance(seen, StorageError):
            return seen.transient
        if is_transient(seen) or is_transient_in_transit(seen) or error_code(seen) in _OUTAGE_CODES:
            return True
    return False


def backoff_s(tries: int, rng: Callable[[], float] = random.random) -> float:
    """The wait after `tries` failed tries (1, 2, ...): 2, 4, 8 ... 60 s, each drawn in [half, all]."""
    full = min(LONGEST_WAIT_S, FIRST_WAIT_S * 2 ** (tries - 1))
    return full * (JITTER_LOW + (1 - JITTER_LOW) * rng())


def wait_out_outages(
    call: Callable[[], T],
    what: str,
    patience_s: float,
    setting: str = "resilience.outage_patience_s",
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`call()`, repeated while it fails as an outage (`is_outage`) and `patience_s` has not run out since
    the first failure; other errors are raised at once. Past the patience: a transient StorageError naming
    `what`, how long it waited, the last error and `setting` (the knob that sets the patience)."""
    started, tries = None, 0
    while True:
        try:
            result = call()
        except Exception as err:
            if not is_outage(err):
                raise
            now = clock()
            started = now if started is None else started
            tries += 1
            left = patience_s - (now - started)
            if left <= 0:
                raise StorageOutageError(
                    f"{what}: S3 did not answer for {now - started:.0f} s (the wait, {setting}: "
                    f"{patience_s:g} s; last error: {redact_url(str(err))}): {OUTAGE_NOT_A_SETTING}"
                ) from None
            wait = min(left, backoff_s(tries))
            log.warning(
                "%s: S3 is not answering (%s); trying again in %.0f s", what, redact_url(str(err)), wait
            )
            sleep(wait)
            continue
        if started is not None:
            log.warning("%s: S3 answered again after %.0f s", what, clock() - started)
        return result


def s3_answers(uri: str) -> None:
    """Return once the S3 server of `uri` answers a request about its bucket; any answer counts, a refusal
    too (a role without s3:ListBucket gets 403 on HeadBucket and may still read every object). Raises
    what botocore raises when nothing answers."""
    from shared import storage

    bucket, _ = storage.split_s3(uri)
    try:
        _probe_client(os.environ.get("S3_ENDPOINT_URL") or None).head_bucket(Bucket=bucket)
    except Exception as err:
        if is_outage(err):
            raise


@functools.lru_cache(maxsize=4)
def _probe_client(endpoint: str | None) -> Any:
    """A client that asks once (wait_out_outages does the waiting): with botocore's 8 attempts one probe of
    a server that is gone took up to two minutes of backoff, past any patience shorter than that."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": 1}, connect_timeout=PROBE_TIMEOUT_S, read_timeout=PROBE_TIMEOUT_S
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
