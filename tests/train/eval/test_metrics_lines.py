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
