"""`python -m train estimate [CONFIG] [key=value ...]` (`make estimate`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from shared.config import ConfigError, config_to_dict
from shared.estimate.config import load_estimate_config
from shared.estimate.gpus import DEFAULT_CONFIG
from shared.estimate.model import estimate, sweep_gpu_counts
from shared.estimate.report import render_table, write_outputs

# ------------------------------------------------------------------------------------------------ CLI


def estimate_command(
    config: str = typer.Argument(DEFAULT_CONFIG, help="jobs/estimate/<name>.yaml or a path to a YAML"),
    overrides: list[str] | None = typer.Argument(
        None, help="key=value, e.g. gpus=256 gpu.type=H100 pricing.mode=reserved throughput_from=bench.json"
    ),
) -> None:
    """Turn measured throughput into days, GPU-hours and dollars; write JSON, markdown and a plot."""
    overrides = list(overrides or [])
    if "=" in config and not Path(config).exists():  # `estimate gpus=256`: overrides, default config
        config, overrides = DEFAULT_CONFIG, [config, *overrides]
    try:
        cfg = load_estimate_config(config, overrides)
        est, sweep = estimate(cfg), sweep_gpu_counts(cfg)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(render_table(est))
    paths = write_outputs(est, sweep, cfg.out_dir)
    paths["config"] = Path(cfg.out_dir) / "config.json"  # the resolved inputs, next to the numbers
    paths["config"].write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    typer.echo("wrote " + ", ".join(str(p) for p in paths.values()))
