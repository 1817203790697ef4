"""The run's loss plot: training loss per step (and its running mean) with the held-out loss of the EMA
and the training weights at each eval, from metrics.jsonl.

The file is read line by line into two float arrays (each line's dict was kept: 1.4 GB and 9 s at 1M steps,
at every eval) and the curves are drawn from at most MAX_POINTS points (bucket means), which matplotlib
draws in a fraction of a second at any run length.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

LOSS_PLOT = "loss.png"
SMOOTHING = 20  # steps in the running mean of the training loss
MAX_POINTS = 10_000  # per curve
_EVAL_KEYS = {weights: f"eval/{weights}/loss" for weights in ("ema", "training")}


def read_series(metrics: Path) -> tuple[array, array, dict[str, list[tuple[float, float]]]]:
    """(steps, training loss, {weights: [(step, held-out loss)]}) of metrics.jsonl; damaged lines skipped."""
    steps, loss = array("d"), array("d")
    evals: dict[str, list[tuple[float, float]]] = {weights: [] for weights in _EVAL_KEYS}
    if not metrics.exists():
        return steps, loss, evals
    with metrics.open("rb") as handle:
        for line in handle:
            try:
                row: dict[str, Any] = json.loads(line)
            except ValueError:
                continue
            if "loss" in row:
                steps.append(float(row["step"]))
                loss.append(float(row["loss"]))
            for weights, key in _EVAL_KEYS.items():
                if key in row:
                    evals[weights].append((float(row["step"]), float(row[key])))
    return steps, loss, evals


def bucket_means(x: Any, y: Any, points: int = MAX_POINTS) -> tuple[Any, Any]:
    """`x`, `y` (numpy arrays) as at most `points` points: the means of consecutive equal buckets."""
    import numpy as np

    if len(x) <= points:
        return x, y
    edges = np.linspace(0, len(x), points + 1).astype(int)
    counts = np.diff(edges)
    return np.add.reduceat(x, edges[:-1]) / counts, np.add.reduceat(y, edges[:-1]) / counts


def plot_losses(metrics: Path, out: Path, title: str = "loss") -> None:
    import numpy as np
    from matplotlib.figure import Figure  # not pyplot: no global state, so it may draw on any thread

    raw_steps, raw_loss, evals = read_series(metrics)
    steps, loss = np.frombuffer(raw_steps, dtype=np.float64), np.frombuffer(raw_loss, dtype=np.float64)
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if len(loss):
        ax.plot(*bucket_means(steps, loss), alpha=0.3, label="training loss (fresh noise)")
    if len(loss) >= SMOOTHING:
        smooth = np.convolve(loss, np.ones(SMOOTHING) / SMOOTHING, mode="valid")
        ax.plot(*bucket_means(steps[SMOOTHING - 1 :], smooth), label=f"{SMOOTHING}-step mean")
    for (weights, points), marker in zip(evals.items(), ("o", "s"), strict=True):
        if points:
            ax.plot(*zip(*points, strict=True), marker=marker, label=f"held-out loss, {weights} weights")
    ax.set(xlabel="optimizer step", ylabel="denoising MSE", title=title)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
