"""metrics.jsonl keeps one line per step with the held-out loss: joined to the step's pending record, or
to the step's line when that was already written, never a second line for the step."""

from __future__ import annotations

import json
from pathlib import Path

from train.loop.metrics import MetricsJSONL


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_joins_its_steps_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2)))
    sink = MetricsJSONL(str(path))
    sink.log_metrics({"eval/ema/loss": 0.25, "eval/ema/loss_t100": 0.5}, step=2)  # line 2 is written
    assert lines(path)[-1] == {"step": 2, "loss": 0.5, "eval/ema/loss": 0.25, "eval/ema/loss_t100": 0.5}
    sink.records[3] = {"step": 3}  # step 3 ended, its loss not flushed yet
    sink.log_metrics({"eval/ema/loss": 0.2}, step=3)
    sink.log_metrics({"loss/train/total": 0.4}, step=3)
    assert lines(path)[-1] == {"step": 3, "eval/ema/loss": 0.2, "loss": 0.4}
    assert [line["step"] for line in lines(path)] == [1, 2, 3]
    sink.log_metrics({"eval/ema/loss": 0.1}, step=7)  # no line for the step (a run without StepLossLog)
    assert lines(path)[-1] == {"step": 7, "eval/ema/loss": 0.1}


def test_a_resume_cuts_the_file_after_its_step_reading_back_only_that_far(tmp_path: Path) -> None:
    """Every start read and rewrote the whole file (1M steps: 222 MB, 3.8 s, 745 MB of memory) and a kill
    during the rewrite lost the history; it now truncates where the resumed step's line ends."""
    path = tmp_path / "metrics.jsonl"
    steps = range(1, 3001)  # ~150 KB: the cut point lies blocks back from the end
    text = "".join(json.dumps({"step": s, "loss": 0.5, "pad": "x" * 20}) + "\n" for s in steps)
    for resumed, expected in ((3000, 3000), (1234, 1234), (2999, 2999), (0, 0), (5000, 3000)):
        path.write_text(text)
        MetricsJSONL(str(path))._drop_lines_after(resumed)
        assert [line["step"] for line in lines(path)] == list(range(1, expected + 1)), resumed
    path.write_text(text + '{"step": 3001, "lo')  # a kill in the middle of a line
    MetricsJSONL(str(path))._drop_lines_after(3001)
    assert path.read_text() == text


def test_the_loss_plot_reads_a_long_run_into_arrays_and_draws_at_most_max_points(tmp_path: Path) -> None:
    """Every eval read the whole file into dicts and drew every step (1M steps: 1.4 GB, 9 s each time)."""
    from train.eval.plot import MAX_POINTS, bucket_means, plot_losses, read_series

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 30_001)]
    rows[999]["eval/ema/loss"] = 0.5
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 30001, "lo')
    steps, loss, evals = read_series(path)
    assert len(steps) == len(loss) == 30_000 and evals == {"ema": [(1000.0, 0.5)], "training": []}
    import numpy as np

    x, y = bucket_means(np.asarray(steps), np.asarray(loss))
    assert len(x) == MAX_POINTS and x[0] == 2.0 and abs(y.sum() * 3 - np.asarray(loss).sum()) < 1e-6
    plot_losses(path, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 0
