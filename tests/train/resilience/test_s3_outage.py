"""S3 outages during a run, through the real launch (supervisor, torchrun, one CPU rank) with data and
checkpoints in S3 (SeaweedFS) behind a proxy that goes down on cue (tests/s3_outage.py).

Before: a 60 s outage at a checkpoint upload stopped the run at its next step (360 lines of traceback), the
checkpoint never reached S3, and the restart began from scratch while the supervisor said it resumed from
that checkpoint. Now:
1. a run whose step-4 checkpoint uploads into an outage waits it out in the background: no restart;
2. resumed to step 12, whose last checkpoint uploads into an outage longer than
   resilience.outage_patience_s: the rank stops on one line as an outage, the supervisor restarts it
   without counting a crash (step 12's save never arrived), the restarted rank waits for S3 at its start,
   then stops resumable (75);
3. the rerun once S3 is back resumes from step 8 and ends on the uninterrupted run's weights.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from shared import storage
from shared.launch import control
from shared.storage.s3_server import S3Server
from tests.leftovers import short_folder
from tests.s3_outage import outage_proxy
from tests.train.checkpoints.test_resume_ranks import assert_same_weights
from tests.train.conftest import (
    REPO_ROOT,
    job_env,
    single_threaded_torch,
    tiny_config,
    tiny_overrides,
    write_fake_dataset,
)
from train.checkpoints.files import find_latest_checkpoint, read_checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.s3]

SETTINGS = ["samples.enabled=false", "save_interval=4ba", "ema.smoothing=0.9", "max_duration=12ba"]
PATIENCE_S = 10  # resilience.outage_patience_s of the run
FIRST_OUTAGE_S = 5  # under the patience: waited out
RUN_TIMEOUT_S = 300
WEIGHT_ATOL = 1e-6  # one rank, same samples: a resumed run matches to float noise (issue 15's bound)


def final_state(save: str, tmp: Path) -> dict[str, Any]:
    latest = find_latest_checkpoint(save)
    assert latest is not None
    local = tmp / Path(latest).name
    local.write_bytes(storage.read_bytes(latest))
    return read_checkpoint(local)["state"]


def launch(data: str, save: str, tmp: Path, ctl: Path, endpoint: str, log: Path, *extra: str) -> int:
    local = f"log.local_dir={tmp / 'local'}"
    overrides = tiny_overrides(data, save, tmp / "cache", *SETTINGS, local, *extra)
    overrides.append(f"resilience.outage_patience_s={PATIENCE_S}")
    argv = [sys.executable, "-m", "train", "launch", "--config", "tiny", "--gpus", "1", *overrides]
    # One botocore attempt in Composer's and Streaming's clients: each failed upload try is seen at once,
    # not after their backoff (up to minutes); the waiting is ours. A short TMPDIR: Composer's uploader
    # keeps a Unix socket in it.
    env = {**job_env(), "S3_ENDPOINT_URL": endpoint, "TMPDIR": str(ctl), "AWS_MAX_ATTEMPTS": "1"}
    with log.open("ab") as out:
        proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=RUN_TIMEOUT_S, check=False)  # fmt: skip
    return proc.returncode


def test_s3_outages_are_waited_out_or_outlasted_and_resumed(s3_server: S3Server, tmp_path: Path) -> None:
    prefix = f"s3://{s3_server.bucket}/outage-{uuid.uuid4().hex[:12]}"
    data = f"{prefix}/data"
    write_fake_dataset(data, n=64)  # 8 batches of 8 an epoch

    reference = f"{prefix}/reference"
    with single_threaded_torch():
        from train.loop.trainer import fit

        fit(
            tiny_config(
                data, reference, tmp_path / "ref-cache", *SETTINGS, f"log.local_dir={tmp_path / 'ref'}"
            )
        )

    save, logs = f"{prefix}/run", [tmp_path / f"launch-{n}.log" for n in range(3)]
    with outage_proxy(s3_server.endpoint) as proxy, short_folder("sdo-") as ctl:
        # 1
        proxy.down_when("-ba4-rank0.pt", seconds=FIRST_OUTAGE_S)
        assert launch(data, save, tmp_path, ctl, proxy.endpoint, logs[0], "max_duration=8ba") == 0
        text = logs[0].read_text()
        assert len(proxy.outages) == 1, proxy.outages
        # The upload's own requests (botocore's 8 attempts) may carry a 5 s outage; when they do not, the
        # upload waits it out and says so: "uploading the checkpoint file ...: S3 answered again after".
        assert "S3 answered again after" not in text or "uploading the checkpoint file" in text, text[-6000:]
        supervisor = [line for line in text.splitlines() if line.startswith("supervisor:")]
        assert not [line for line in supervisor if "restart" in line], supervisor  # waited out: no restart
        # 2
        proxy.down_when("-ba12-rank0.pt")  # until the test brings it up
        code = launch(data, save, tmp_path, ctl, proxy.endpoint, logs[1])
        text = logs[1].read_text()
        assert code == control.EXIT_RESUMABLE, text[-6000:]
        supervisor = [line for line in text.splitlines() if line.startswith("supervisor:")]
        restarts = [line for line in supervisor if "restart" in line]
        assert len(restarts) == 1 and "S3 outage at step 12" in restarts[0], supervisor
        assert "step 12's was still uploading" in restarts[0] and "not counted as a crash" in restarts[0]
        assert "starting: s3://" in text and "rerun the same command once S3 answers" in supervisor[-1]
        assert "Traceback" not in text, text[-6000:]
        # 3
        proxy.up()
        assert launch(data, save, tmp_path, ctl, proxy.endpoint, logs[2]) == 0, logs[2].read_text()[-6000:]
    assert "ep0-ba8-rank0.pt" in logs[2].read_text()  # resumed from the last checkpoint that arrived
    assert_same_weights(final_state(save, tmp_path), final_state(reference, tmp_path), WEIGHT_ATOL)
