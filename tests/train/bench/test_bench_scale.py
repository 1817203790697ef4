"""`make bench`'s scale section (issue 11): counters that must not grow with the cluster, asserted so a
regression fails here. Host syncs are counted exactly; the Python-side share is a timing and only has to
be measured (a loaded shared CPU makes any bound on it flaky)."""

from __future__ import annotations

from pathlib import Path

from tests.train.bench.test_bench import MINIMAL
from train.bench.config import load_bench_config
from train.bench.report import findings
from train.bench.run import run_bench

# The trainer section only: 1 warm-up batch, then 6 timed ones (the tiny recipe flushes its log at 5).
ONLY_TRAINER = [
    "step.resolutions=[64]", "step.online=false", "loader.enabled=false", "encode.enabled=false",
    "trainer.batches=6", "trainer.warmup=1",
]  # fmt: skip


def test_scale_section_counts_host_syncs_and_python_share(tmp_path: Path) -> None:
    overrides = [*MINIMAL, *ONLY_TRAINER, f"out_dir={tmp_path / 'out'}", f"work_dir={tmp_path / 'work'}"]
    result = run_bench(load_bench_config("quick", overrides))
    scale = result["scale"]
    # Neither the train job nor Composer's loop reads anything back between log flushes.
    assert scale["host_syncs_per_step"] == {"train": 0, "composer": 0}
    assert scale["host_sync_places"] == []
    assert 0 <= scale["python_side_share"] < 1 and scale["python_side_share_target"] == 0.05
    trainer = result["trainer"]  # the step work is timed inside Composer's batch, and is most of it
    assert 0 < trainer["in_step_s"] < trainer["wall_per_batch_s"]
    # 1 + 6 + 2 flow batches over 8 rows: Composer fires BEFORE_DATALOADER twice at the epoch's end, and
    # that stays one batch, so every batch is timed once and the flow batches all run
    assert trainer["batches_timed"] == 6 and trainer["flow"]["batches"] == 2
    assert any(note.startswith("scale: ") for note in findings(result))
