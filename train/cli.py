"""`python -m train fit|export|eval|eval-images|launch|bench|estimate|demo|tiny-vae ...`: thin wrappers
over the library."""

from __future__ import annotations

import logging
import os
import shutil

import typer

from shared.launch.control import EXIT_FATAL
from shared.runtime.exits import Stop, add_debug_option, guard_commands, main, path_problem
from shared.storage.errors import OUTAGE_NOT_A_SETTING

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


add_debug_option(app)


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
    from train.checkpoints.owner import SaveFolderInUseError
    from train.checkpoints.record import DatasetChangedError, ObjectiveChangedError
    from train.data.loader import DataError
    from train.ema.names import EMAStoreMismatchError
    from train.export.pipeline import ExportError
    from train.loop.guards import NonFiniteLossError
    from train.loop.prepare import RunFinishedError

    return (
        ConfigError,
        DatasetChangedError,
        ObjectiveChangedError,
        ExportError,
        ContractError,
        BatchingError,
        CheckpointError,
        UnsafeCheckpointError,
        SaveFolderInUseError,
        DataError,
        StorageError,
        EncoderMismatchError,
        TextLayerError,
        EMAStoreMismatchError,
        NonFiniteLossError,
        RunFinishedError,
        FileNotFoundError,
    )


def classify(err: BaseException) -> Stop | None:
    """Expected stops of train commands (shared/runtime/exits.py): the message names the fix; None: a bug."""
    from shared.storage import redact_url
    from train.checkpoints.owner import SaveFolderTakenError
    from train.resilience.exits import ResumableStop, peer_lost, resumable_exit_code
    from train.resilience.outage import StorageOutageStop

    if lost := peer_lost(err):  # another rank died: one line, exit 1 as before (torchrun restarts)
        return Stop(1, prefix="", message=lost)
    quiet = int(os.environ.get("RANK", "0")) != 0
    if isinstance(err, ResumableStop):  # saved on a signal or a deadline: one line (rank 0's), rerun
        # 75, or 0 under a supervisor that exits 75 itself (torchrun restarts ranks that exit non-zero)
        return Stop(resumable_exit_code(), prefix="", quiet=quiet)
    if isinstance(err, StorageOutageStop):  # S3 never answered at the start: rerun later, as a stop
        return Stop(resumable_exit_code(), quiet=quiet)
    if _is_outage(err):  # exit 1 like a crash: the supervisor restarts from the last checkpoint
        what = redact_url(str(err))  # a library's error text can carry the endpoint's credentials
        if not what.endswith(OUTAGE_NOT_A_SETTING):  # shared/storage/outage.py's errors say it already
            what += f" ({OUTAGE_NOT_A_SETTING})"
        return Stop(1, message=f"{what}: a rerun resumes from the last checkpoint")
    if isinstance(err, SaveFolderTakenError):  # every rank stops on it: rank 0's line names the taker
        return Stop(EXIT_FATAL, quiet=quiet)
    if isinstance(err, _user_errors()):
        return Stop(EXIT_FATAL)
    return path_problem(err)


def _tell_the_supervisor(err: BaseException) -> None:
    """An error classify ends with exit 2 is one no restart fixes: the supervisor stops instead of restarting
    (shared/launch/supervisor.py). An outage (exit 1) or a bug it restarts."""
    from train.loop.prepare import RunFinishedError
    from train.resilience.exits import record_fatal

    stop = classify(err)
    if stop is not None and stop.code == EXIT_FATAL:
        record_fatal(err, "finished" if isinstance(err, RunFinishedError) else "fatal")
    elif stop is not None and stop.code == 1 and _is_outage(err):
        record_fatal(err, "outage")  # the supervisor's first restart after one is not a crash (supervisor.py)


def _is_outage(err: BaseException) -> bool:
    """S3 failing as an outage does, ours (a transient StorageError) or a library's (Composer's uploader,
    Streaming's downloads: botocore's connection errors, 5xx, throttling; shared/storage/outage.py)."""
    from shared.storage.outage import is_outage

    return is_outage(err)


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
    from train.loop.prepare import RunFinishedError
    from train.loop.trainer import fit as run_fit

    _quiet_tracker_under_torchrun()
    try:
        cfg = load_config(TrainConfig, config, overrides or [], kind="train")
        _warn_unused_gpus()
        trainer = run_fit(cfg)
    except Exception as err:
        if isinstance(err, ValueError) and "elapsed training duration" in str(err):
            # Composer's own finished-run check, for max_duration in epochs or samples
            finished = RunFinishedError(
                f"the run in {cfg.save_folder} already reached max_duration={cfg.max_duration}: "
                "raise max_duration to train it longer, or set save_folder=<a new folder>"
            )
            _tell_the_supervisor(finished)
            raise finished from err
        _tell_the_supervisor(err)
        raise
    typer.echo(f"done at {trainer.state.timestamp.batch.value} batches; checkpoints in {cfg.save_folder}")


# Python's resource tracker warns "There appear to be N leaked shared_memory objects" when it unlinks what a
# dead process registered (and "No such file" for what another process removed first).
TRACKER_WARNINGS = "ignore:resource_tracker:UserWarning"


def _quiet_tracker_under_torchrun() -> None:
    """A torchrun rank can be killed (a peer died; torchrun SIGKILLs the rest): its resource tracker then
    unlinks the Streaming segments the rank made, as it should, and warns about each; the supervisor's
    restart line says what happened. The tracker is a process of its own, started with the first segment,
    so the filter goes through its environment. Single-process runs keep the warning (a real leak)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        current = os.environ.get("PYTHONWARNINGS", "")
        os.environ["PYTHONWARNINGS"] = f"{current},{TRACKER_WARNINGS}" if current else TRACKER_WARNINGS


def _warn_unused_gpus() -> None:
    from shared.runtime.device import unused_gpus_warning

    if warning := unused_gpus_warning("train"):
        typer.secho(warning, err=True, fg="yellow", bold=True)


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
    from train.export.pipeline import export_pipeline

    _setup_logging()
    result = export_pipeline(checkpoint, out, sampler, weights, allow_encoder_mismatch)  # type: ignore[arg-type]
    typer.echo(f"exported {result.weights} weights of {result.checkpoint} to {result.out}")


@app.command("eval")
def eval_checkpoint(
    checkpoint: str = typer.Argument(
        ..., help="a checkpoint .pt or a save folder (its latest), local or s3://"
    ),
    overrides: list[str] = typer.Argument(None, help="eval settings, e.g. uri=s3://b/val num_samples=256"),
    weights: str = typer.Option("ema", help="ema (default) or training"),
    out: str = typer.Option("", help="write the metrics as flat JSON here (local or s3://)"),
    size: str = typer.Option("", help="HxW px: a bucket of a bucketed eval dataset (default its square)"),
) -> None:
    """The held-out loss of a checkpoint: the numbers training logged as eval/<weights>/loss*."""
    from train.eval.checkpoint import evaluate_checkpoint, write_metrics

    _setup_logging()
    result = evaluate_checkpoint(checkpoint, weights, overrides or [], size=size)
    if out:
        write_metrics(result, out)
    typer.echo(f"{result.checkpoint} (step {result.step}, {result.weights} weights):")
    for name, value in result.metrics.items():
        typer.echo(f"  {name} {value:.6f}")


@app.command("eval-images")
def eval_images(
    model: str = typer.Argument(
        ..., help="an exported pipeline folder (python -m train export), local or s3://"
    ),
    prompts_from: str = typer.Option(
        ..., help="an encoded dataset (its captions) or a text file, a prompt a line"
    ),
    reference: str = typer.Option(
        ..., help="reference images: a folder, webdataset .tar or img2dataset .parquet"
    ),
    inception_weights: str = typer.Option(..., help="the standard FID Inception weights file (.pth)"),
    clip_model: str = typer.Option(..., help="an open_clip model folder (open_clip_config.json + weights)"),
    out: str = typer.Option(..., help="folder for metrics.json, fid_vs_clip.png and images/"),
    num_images: int = typer.Option(10000, help="images per guidance scale (image i from prompt i)"),
    guidance: str = typer.Option("1.5,4,8", help="comma-separated guidance scales"),
    steps: int = typer.Option(50, help="sampler steps (the pipeline's scheduler)"),
    seed: int = typer.Option(0, help="image i starts from noise seeded by (seed, i): same seed, same images"),
    batch_size: int = typer.Option(8, help="images per pipeline call on each rank"),
    num_reference: int = typer.Option(0, help="reference images to use, in order (0: all)"),
    cache_dir: str = typer.Option("", help="reference feature cache (default: a private temp folder)"),
    size: str = typer.Option("", help="HxW px to generate at, e.g. a bucket trained on (default: square)"),
    device: str = typer.Option("auto", help="auto (each rank's GPU if visible), cpu or gpu"),
) -> None:
    """FID, KID and CLIP score over guidance scales (run under torchrun to split the prompts over GPUs)."""
    from shared.config import ConfigError
    from train.eval.images import ImageEvalSpec, run_eval_images

    _setup_logging()
    try:
        scales = [float(g) for g in guidance.split(",") if g.strip()]
    except ValueError as err:
        raise ConfigError(
            f"--guidance must be comma-separated numbers, e.g. 1.5,4,8; got {guidance!r}"
        ) from err
    spec = ImageEvalSpec(
        model, prompts_from, reference, inception_weights, clip_model, out, num_images, scales, steps,
        seed, batch_size, num_reference, cache_dir, size, device,
    )  # fmt: skip
    report = run_eval_images(spec)
    if report is not None:
        for scale, values in report["guidance"].items():
            typer.echo(f"guidance {scale}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))
        typer.echo(f"wrote {out}/metrics.json, {out}/fid_vs_clip.png and {out}/images/")


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
guard_commands(app, classify)

if __name__ == "__main__":
    main(app, "python -m train")
