"""`make bench` / `python -m train bench [CONFIG] [key=value ...]`."""

from __future__ import annotations

from pathlib import Path

import typer

from shared.config import ConfigError
from train.bench.config import DEFAULT_CONFIG, load_bench_config


def bench_command(
    config: str = typer.Argument(
        DEFAULT_CONFIG, help="jobs/bench/<name>.yaml (quick, full, sd2-base-cpu) or a path"
    ),
    overrides: list[str] | None = typer.Argument(
        None, help="key=value, e.g. preset=sd2-base step.batch_size=32 peak_tflops=2.0 encode.enabled=false"
    ),
) -> None:
    """Measure train-step, loader, trainer and encode throughput, FLOPs and MFU; write JSON + markdown."""
    overrides = list(overrides or [])
    if "=" in config and not Path(config).exists():  # `bench step.repeats=5`: overrides, default config
        config, overrides = DEFAULT_CONFIG, [config, *overrides]
    try:
        cfg = load_bench_config(config, overrides)
        # Imported here, in the command: the runner and the report pull in torch and composer, and every
        # `python -m train` command (which registers this one) must not pay for them.
        from train.bench.report import render_markdown, write_outputs
        from train.bench.run import run_bench

        result = run_bench(cfg)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    paths = write_outputs(result, cfg.out_dir)
    typer.echo(render_markdown(result))
    typer.echo("wrote " + ", ".join(str(p) for p in paths.values()))
