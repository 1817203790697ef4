"""The run's loss plot: training loss per step (and its running mean) with the held-out loss of the EMA
and the training weights at each eval, from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

LOSS_PLOT = "loss.png"
SMOOTHING = 20  # steps in the running mean of the training loss


def read_lines(metrics: Path) -> list[dict[str, float]]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def plot_losses(metrics: Path, out: Path, title: str = "loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = read_lines(metrics)
    steps = np.array([r["step"] for r in rows if "loss" in r])
    loss = np.array([r["loss"] for r in rows if "loss" in r])
    fig, ax = plt.subplots(figsize=(7, 4))
    if len(loss):
        ax.plot(steps, loss, alpha=0.3, label="training loss (fresh noise)")
    if len(loss) >= SMOOTHING:
        smooth = np.convolve(loss, np.ones(SMOOTHING) / SMOOTHING, mode="valid")
        ax.plot(steps[SMOOTHING - 1 :], smooth, label=f"{SMOOTHING}-step mean")
    for weights, marker in (("ema", "o"), ("training", "s")):
        key = f"eval/{weights}/loss"
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points, strict=True), marker=marker, label=f"held-out loss, {weights} weights")
    ax.set(xlabel="optimizer step", ylabel="denoising MSE", title=title)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
