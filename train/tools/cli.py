"""`python -m train demo` (`make demo`) and `python -m train tiny-vae` (`make tiny-vae`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from shared.presets import ASSETS
from train.tools.demo import run_demo

# Defaults of the VAE run (train/tools/tiny_vae.py, repeated here so `--help` needs no torch import).
TINY_VAE_STEPS = 1500
TINY_VAE_PER_SHARD = 128


def demo_command(
    out: Annotated[Path, typer.Option("--out", help="where everything goes")] = Path("outputs/demo"),
    max_duration: Annotated[
        str | None, typer.Option("--max-duration", help="override jobs/train/tiny.yaml, e.g. 100ba")
    ] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="delete earlier demo outputs first")] = False,
    dataset: Annotated[
        str,
        typer.Option(
            "--dataset",
            help="jobs/datasets config, e.g. sample-buckets (aspect-ratio buckets, into <out>-buckets)",
        ),
    ] = "sample",
) -> None:
    """Sample data -> encode -> train a tiny U-Net -> export + generate; prints where everything went."""
    run_demo(out, max_duration, fresh, dataset)


def tiny_vae_command(
    out: Annotated[Path, typer.Option("--out", help="folder for the weights + JSON")] = ASSETS,
    steps: Annotated[int, typer.Option("--steps", help="training steps")] = TINY_VAE_STEPS,
    seed: Annotated[int, typer.Option("--seed", help="init, batch order and posterior noise")] = 0,
    per_shard: Annotated[
        int, typer.Option("--per-shard", help="images per shard (smoke runs)")
    ] = TINY_VAE_PER_SHARD,
    grid_dir: Annotated[
        Path | None, typer.Option("--grid-dir", help="also write original/reconstruction PNGs")
    ] = None,
) -> dict[str, Any]:
    """Retrain the tiny preset's VAE on the sample data (writes shared/assets/ by default)."""
    # Imported when the command runs: it needs torch, which `python -m train --help` must not load.
    from train.tools.tiny_vae import run

    info = run(out, steps, seed, per_shard, grid_dir)
    typer.echo(json.dumps(info, indent=2))
    return info
