"""S3 end to end against the SeaweedFS fixture: stream s3:// data, checkpoint to s3://, autoresume, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared import storage
from tests.train.conftest import tiny_config, write_fake_dataset
from train.checkpoints.files import find_latest_checkpoint
from train.export.pipeline import export_pipeline
from train.loop.trainer import fit


@pytest.mark.s3
# slow: Composer's S3 uploader spawns worker processes (each re-imports Composer) and polls every 30 s
@pytest.mark.slow
def test_train_from_s3_data_to_s3_checkpoints_then_resume_and_export(s3_prefix: str, tmp_path: Path) -> None:
    data, save = f"{s3_prefix}/data", f"{s3_prefix}/run"
    write_fake_dataset(data, n=16)  # 2 batches of 8 per epoch
    common = ["save_interval=2ba", "samples.interval=4ba"]
    local1 = f"log.local_dir={tmp_path / 'local1'}"
    first = fit(tiny_config(data, save, tmp_path / "cache1", "max_duration=4ba", local1, *common))
    assert int(first.state.timestamp.batch) == 4
    assert find_latest_checkpoint(save) == f"{save}/ep1-ba4-rank0.pt"
    for name in ("metrics.jsonl", "train_config.yaml", "samples/ba00000004.png"):
        assert storage.exists(f"{save}/{name}"), name

    # Resume "on another machine": a fresh local folder; the remote metrics history is extended, not replaced.
    local2 = f"log.local_dir={tmp_path / 'local2'}"
    keep = "save_num_remote_checkpoints_to_keep=2"
    second = fit(tiny_config(data, save, tmp_path / "cache2", "max_duration=6ba", local2, keep, *common))
    assert int(second.state.timestamp.batch) == 6  # continued from ba4, not from scratch
    assert find_latest_checkpoint(save) == f"{save}/ep2-ba6-rank0.pt"
    remote = sorted(storage.relpath(f.uri, save) for f in storage.list_files(save) if f.uri.endswith(".pt"))
    assert remote == ["ep1-ba4-rank0.pt", "ep2-ba6-rank0.pt"]  # ba2 pruned: Composer itself never would
    lines = storage.read_bytes(f"{save}/metrics.jsonl").decode().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]

    result = export_pipeline(save, f"{s3_prefix}/export")
    assert result.weights == "ema" and result.checkpoint.endswith("ep2-ba6-rank0.pt")
    assert storage.exists(f"{s3_prefix}/export/model_index.json")
    assert storage.exists(f"{s3_prefix}/export/unet/diffusion_pytorch_model.safetensors")


def test_a_failed_copy_of_the_run_folder_never_stops_the_run_and_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An S3 outage at a checkpoint: copying the log and metrics was a fatal error, which stopped an
    unattended run for good ('a restart cannot fix this') while S3 came back seconds later."""
    from train.loop.metrics import ArtifactMirror

    local = tmp_path / "run"
    local.mkdir()
    (local / "metrics.jsonl").write_text('{"step": 1}\n')
    sent: dict[str, bytes] = {}
    down = [True]

    def put(uri: str, data: bytes) -> None:
        if down[0]:
            raise storage.StorageError(f"S3 request for {uri} failed: Could not connect", transient=True)
        sent[uri] = data

    monkeypatch.setattr(storage, "write_bytes", put)
    mirror = ArtifactMirror(str(local), "s3://bkt/run", "1ba")
    with caplog.at_level("WARNING"):
        mirror.sync()
    assert "could not copy 1 file(s) (metrics.jsonl) to s3://bkt/run" in caplog.text and not sent
    down[0] = False
    mirror.sync()
    assert sent == {"s3://bkt/run/metrics.jsonl": b'{"step": 1}\n'}
