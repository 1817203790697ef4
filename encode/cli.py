"""`python -m encode run|finalize|gc|launch|sample-data ...`: thin wrappers over the library."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import typer

from encode.config import EncodeConfig
from encode.launch import launch_command
from encode.sample_data import BUILDERS
from encode.sample_data import build as build_sample_data
from shared.config import ConfigError, load_config
from shared.runtime.exits import Stop, add_debug_option, guard_commands, path_problem
from shared.runtime.exits import main as run_app

HELP_WIDTH = shutil.get_terminal_size((120, 24)).columns  # COLUMNS, the terminal, or 120 when piped
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Encode images + captions into MDS latents.",
    # Plain click help: flags without `<bool>` type columns; 120 columns when piped (the terminal's own
    # width otherwise), where rich's boxes cut long help at 80.
    rich_markup_mode=None,
    context_settings={
        "terminal_width": HELP_WIDTH,
        "max_content_width": 120,
    },
)

DATASET_HELP = "a name in jobs/datasets/ (e.g. sample, laion400m) or a path to a YAML file"
OVERRIDES_HELP = "dotted overrides, e.g. output.uri=s3://bucket/x preset=tiny transform.resolutions=[256]"
# A rank may wait at the final barrier for the slowest rank of a multi-day encode.
BARRIER_TIMEOUT = timedelta(days=7)


add_debug_option(app)


def load(dataset: str, overrides: list[str] | None) -> EncodeConfig:
    return load_config(EncodeConfig, dataset, overrides or [], kind="datasets")


def classify(err: BaseException) -> Stop | None:
    """Expected stops (shared/runtime/exits.py): problems the user fixes (a bad config, a wrong path, missing
    credentials, a contract mismatch, another live run of the same ranks) exit 2 with one line; unfinished
    partitions at publish exit 1."""
    from encode.plan.claims import OutputInUseError
    from encode.publish.finalize import NotFinishedError
    from encode.sources import SourceError
    from shared.contract import ContractError
    from shared.storage import StorageError

    if isinstance(err, NotFinishedError):
        return Stop(1, prefix="")
    user_fixes = (FileNotFoundError, SourceError, StorageError, ConfigError, ContractError, OutputInUseError)
    if isinstance(err, user_fixes):
        return Stop(2)
    return path_problem(err)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


@app.command()
def run(
    dataset: str = typer.Argument(..., help=DATASET_HELP),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP),
) -> None:
    """Encode this rank's unfinished partitions; rank 0 then publishes the dataset version."""
    from encode.pipeline import RankInfo, run_rank
    from encode.plan.claims import claimed_rank
    from encode.process.encoders import load_encoders, pick_encode_device
    from encode.publish.finalize import publish
    from encode.report import print_publish, print_rank
    from encode.sources import list_partitions
    from shared.manifest import Layout
    from shared.runtime.device import unused_gpus_warning

    setup_logging()
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    cfg = load(dataset, overrides)
    rank = RankInfo.from_env()
    if warning := unused_gpus_warning("encode"):
        typer.secho(warning, err=True, fg="yellow", bold=True)
    start = time.perf_counter()
    partitions = list_partitions(cfg.source)  # a wrong path fails here, before the models load
    pick_encode_device(cfg)  # a node that sees no GPU stops here, before it claims or writes anything
    # Claimed before the models load: a second run of the same ranks stops here, naming the first.
    with claimed_rank(Layout(cfg.output.uri), rank.rank, rank.world_size, f"encode {cfg.name}"):
        encoders = load_encoders(cfg)
        summary = run_rank(cfg, rank, encoders, partitions)
        print_rank(summary)
        joined = wait_for_all_ranks(rank.world_size)
        if summary.failed:
            raise typer.Exit(1)
        if rank.rank == 0 and (rank.world_size == 1 or joined):
            result = publish(cfg, encoders)
            print_publish(result, cfg, time.perf_counter() - start)


def stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a scheduler's stop, torchrun's teardown, `kill`) ends encode like Ctrl-C does: by an
    exception, so what it holds is cleaned up on the way out (staged shards, reuse tables' decompressed
    copies, torch's import-time temp folder); the default action ended the process on the spot, leaving them
    in the temp folder. Finished partitions are kept: a rerun redoes only the others."""
    typer.echo("encode: stopped by SIGTERM; rerun the same command (finished partitions are kept)", err=True)
    raise SystemExit(128 + signum)


def wait_for_all_ranks(world_size: int) -> bool:
    """Barrier over torch.distributed (gloo) when launched by torchrun / Composer's launcher.

    Joining only at the end means a rank that crashed early cannot hang the others mid-encode. Ranks
    launched as independent scheduler tasks (no MASTER_ADDR, e.g. a Slurm array) don't join; their launch
    plan runs `encode finalize` after all of them instead.
    """
    if world_size == 1 or "MASTER_ADDR" not in os.environ:
        return False
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
    dist.barrier()
    return True


@app.command()
def finalize(
    dataset: str = typer.Argument(..., help=DATASET_HELP),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP),
) -> None:
    """Merge every finished partition into a new dataset version (after all ranks are done)."""
    from encode.process.encoders import load_encoders
    from encode.publish.finalize import publish
    from encode.report import print_publish

    setup_logging()
    cfg = load(dataset, overrides)
    start = time.perf_counter()
    result = publish(cfg, load_encoders(cfg))
    print_publish(result, cfg, time.perf_counter() - start)


@app.command()
def gc(
    dataset: str = typer.Argument(..., help=DATASET_HELP),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP),
    keep: int = typer.Option(1, help="how many newest versions to keep (the current one always stays)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list what would be deleted, delete nothing"),
    force: bool = typer.Option(False, "--force", help="also delete versions running jobs hold leases on"),
    min_age_minutes: float = typer.Option(
        60, "--min-age-minutes", help="keep partition folders with no done-marker written this recently"
    ),
) -> None:
    """Delete old dataset versions and partition outputs that no kept or leased version uses."""
    from encode.publish.gc import collect_garbage, describe_gc
    from shared.manifest import Layout

    cfg = load(dataset, overrides)
    report = collect_garbage(
        Layout(cfg.output.uri), keep=keep, dry_run=dry_run, force=force, min_age_s=min_age_minutes * 60
    )
    typer.echo("\n".join(describe_gc(report, dry_run)))


@app.command("sample-data")
def sample_data(
    out: Path = typer.Option(..., "--out", help="root folder; data goes to OUT/<format>"),
    fmt: str = typer.Option("webdataset", "--format", help="webdataset, parquet or folder"),
    shards: int | None = typer.Option(None, help="webdataset/parquet: number of shards"),
    per_shard: int | None = typer.Option(None, help="webdataset/parquet: samples per shard"),
    seed: int | None = typer.Option(None),
) -> None:
    """Build the bundled synthetic sample dataset (what `make demo` encodes); prints its source.uri."""
    if fmt not in BUILDERS:
        typer.echo(f"error: --format {fmt} is not one of {', '.join(BUILDERS)}", err=True)
        raise typer.Exit(2)
    typer.echo(str(build_sample_data(fmt, out, shards, per_shard, seed)))


# Light (no torch, no composer): planning a 256-GPU launch answers instantly.
app.command("launch", help="Plan and launch encode ranks on local / Slurm / Kubernetes (see --dry-run).")(
    launch_command
)


guard_commands(app, classify)


def main() -> None:
    run_app(app, "python -m encode")


if __name__ == "__main__":
    sys.exit(main())
