"""`make train ... DRY_RUN=1` prices text.store for the dataset the run will read."""

from __future__ import annotations

import json
from pathlib import Path

from shared.launch.plan import LaunchOptions
from shared.launch.report import describe
from train.launch import plan_train

# SD2-base bytes per sample with token ids (jobs/estimate/sd2-base.yaml's sizes - 157,696 + 154).
TOKENS_BYTES = {"256": 16_758, "512": 65_908}


def tokens_manifest(root: Path) -> Path:
    """The fields the planner reads from an encode manifest (shared/manifest.py), for a tokens dataset."""
    root.mkdir(parents=True)
    n = {"256": 1000, "512": 400}
    resolutions = {r: {"num_samples": n[r], "bytes": n[r] * TOKENS_BYTES[r]} for r in n}
    manifest = {
        "resolutions": resolutions,
        "num_samples": n,
        "samples_read": 1200,
        "encoder": {"text_store": "tokens"},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def dry_run(data: str, tmp_path: Path) -> str:
    overrides = [f"data.uri={data}", f"save_folder={tmp_path / 'save'}"]
    return describe(plan_train("sd2-base-256", overrides, LaunchOptions(256, "slurm")))


def test_dry_run_shows_the_text_store_line_for_its_dataset(tmp_path: Path) -> None:
    out = dry_run(str(tokens_manifest(tmp_path / "ds")), tmp_path)
    line = next(row for row in out.splitlines() if "text.store:" in row)
    assert f"bytes/sample of {tmp_path / 'ds'}" in line and "this dataset stores tokens" in line
    # Sized from the dataset's own bytes, which hold tokens: embeddings priced back at ~186 TiB.
    assert "embeddings 186.2 TiB" in line and "tokens 30.0 TiB" in line and "break-even" in line


def test_dry_run_without_a_readable_dataset_prices_sd2_sizes(tmp_path: Path) -> None:
    out = dry_run(str(tmp_path / "not-encoded-yet"), tmp_path)
    line = next(row for row in out.splitlines() if "text.store:" in row)
    assert "SD2-base bytes/sample" in line and "no readable manifest" in line
