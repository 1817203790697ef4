"""`python -m train fit|export|launch|bench|estimate|demo|tiny-vae ...`: thin wrappers over the library."""

from __future__ import annotations

import logging
import shutil

import typer

HELP_WIDTH = shutil.get_terminal_size((120, 24)).columns  # COLUMNS, the terminal, or 120 when piped
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train the U-Net on encoded latents; export it.",
    # Plain click help: flags without `<bool>` type columns; 120 columns when piped (the terminal's own
    # width otherwise), where rich's boxes cut long help at 80.
    rich_markup_mode=None,
    context_settings={
        "terminal_width": HELP_WIDTH,
        "max_content_width": 120,
    },
)


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors whose message already names the fix: print it, no traceback."""
    from shared.batching import BatchingError
    from shared.config import ConfigError
    from shared.contract import ContractError
    from shared.encoders import EncoderMismatchError
    from shared.models import TextLayerError
    from shared.storage import StorageError
    from train.checkpoints.files import CheckpointError, UnsafeCheckpointError
    from train.data.loader import DataError
    from train.ema.names import EMAStoreMismatchError
    from train.loop.guards import NonFiniteLossError
    from train.loop.prepare import RunFinishedError

    return (
        ConfigError,
        ContractError,
        BatchingError,
        CheckpointError,
        UnsafeCheckpointError,
        DataError,
        StorageError,
        EncoderMismatchError,
        TextLayerError,
        EMAStoreMismatchError,
        NonFiniteLossError,
        RunFinishedError,
        FileNotFoundError,
    )


def _fail(err: Exception) -> None:
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(2)


@app.command()
def fit(
    config: str = typer.Argument(..., help="a name in jobs/train/ (e.g. tiny, sd2-base-256) or a YAML path"),
    overrides: list[str] = typer.Argument(
        None, help="key=value overrides, e.g. data.uri=s3://b/ds max_duration=20ba"
    ),
) -> None:
    """Train (or resume: rerun the same command after a crash)."""
    from shared.config import load_config
    from train.config import TrainConfig

    _setup_logging()
    from train.checkpoints.record import DatasetChangedError
    from train.loop.trainer import fit as run_fit

    try:
        cfg = load_config(TrainConfig, config, overrides or [], kind="train")
        trainer = run_fit(cfg)
    except (*_user_errors(), DatasetChangedError) as err:
        _fail(err)
    except ValueError as err:  # Composer's own finished-run check, for max_duration in epochs or samples
        if "elapsed training duration" not in str(err):
            raise
        _fail(
            ValueError(
                f"the run in {cfg.save_folder} already reached max_duration={cfg.max_duration}: "
                "raise max_duration to train it longer, or set save_folder=<a new folder>"
            )
        )
    typer.echo(f"done at {trainer.state.timestamp.batch.value} batches; checkpoints in {cfg.save_folder}")


@app.command()
def export(
    checkpoint: str = typer.Argument(
        ..., help="a checkpoint .pt or a save folder (its latest), local or s3://"
    ),
    out: str = typer.Argument(..., help="output folder (local or s3://) for the diffusers pipeline"),
    sampler: str = typer.Option("ddim", help="scheduler written into the pipeline: ddim or euler"),
    weights: str = typer.Option("ema", help="ema (default) or training"),
    allow_encoder_mismatch: bool = typer.Option(
        False, help="export even if the VAE/text encoder differ from encode's"
    ),
) -> None:
    """Write a diffusers StableDiffusionPipeline folder from a checkpoint."""
    from train.export.pipeline import ExportError, export_pipeline

    _setup_logging()
    try:
        result = export_pipeline(checkpoint, out, sampler, weights, allow_encoder_mismatch)  # type: ignore[arg-type]
    except (*_user_errors(), ExportError) as err:
        _fail(err)
    typer.echo(f"exported {result.weights} weights of {result.checkpoint} to {result.out}")


def _register_light_commands() -> None:
    """Commands whose modules import neither torch nor composer, so `--help` and planning stay instant."""
    from shared.estimate import estimate_command
    from train.bench.cli import bench_command
    from train.launch import launch_command
    from train.tools.cli import demo_command, tiny_vae_command

    app.command("launch", help="Plan and launch training on local / Slurm / Kubernetes (see --dry-run).")(
        launch_command
    )
    app.command("bench", help="Throughput, FLOPs, MFU, offline speedup, loader and encode rates -> JSON.")(
        bench_command
    )
    app.command("estimate", help="Days, GPU-hours and dollars for a schedule (writes JSON, table, plot).")(
        estimate_command
    )
    app.command("demo", help="make demo: sample data -> encode -> train -> export, on CPU.")(demo_command)
    app.command("tiny-vae", help="Retrain the tiny preset's VAE on the sample data (make tiny-vae).")(
        tiny_vae_command
    )


_register_light_commands()

if __name__ == "__main__":
    app()
