"""`python -m encode launch laion400m --gpus 64 --launcher slurm [--dry-run] [key=value ...]`.

The encode job's launch description: its config (so a bad dataset name fails here, not on 64 GPUs) and how
the index merge runs once every rank is done; shared/launch derives the rest and carries it out. Nothing
here imports torch or composer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Annotated

import typer

from encode.config import EncodeConfig
from shared import storage
from shared.config import load_config
from shared.launch.cli import OverridesArg, launch_command
from shared.launch.plan import (
    ARRAY_JOB_ID,
    LaunchOptions,
    LaunchPlan,
    derive_topology,
    program_target,
    rank_resources,
)
from shared.launch.steps import build_steps

# Host memory per encode rank (GiB), an estimate: the rank's own process holds the VAE encoder and the
# OpenCLIP ViT-H text tower in fp32 while loading (~1.8 GB), the CUDA runtime (~3 GB resident) and a batch of
# up to 128 x 512 px float32 images (~0.4 GB): 8 GiB. Each decode worker holds a Python + torch process
# (~0.5 GB), one sample of up to source.max_sample_bytes (64 MiB) and an image of up to
# source.max_pixels (8192^2 x 3 bytes = 192 MiB) decoded, plus its queued resized arrays: 2 GiB.
ENCODE_BASE_GB = 8
ENCODE_GB_PER_WORKER = 2
FINALIZE_IN_BAND = "rank 0 publishes the dataset version after a barrier once every rank is done (encode run)"
FINALIZE_DEPENDENT = (
    f"a dependent job (sbatch --dependency=afterok:{ARRAY_JOB_ID}) runs `encode finalize` once every array "
    "task succeeded"
)


def load_encode_config(dataset: str, overrides: Sequence[str]) -> EncodeConfig:
    """The full EncodeConfig, so a bad dataset name or override fails here, not on 256 GPUs."""
    return load_config(EncodeConfig, dataset, overrides, kind="datasets")


def plan_encode(
    dataset: str,
    overrides: Sequence[str] = (),
    options: LaunchOptions | None = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """The launch of `python -m encode run DATASET overrides...` on `options.gpus` ranks, then finalize."""
    options = options or LaunchOptions()
    cfg = load_encode_config(dataset, overrides)
    program = ("encode", "run", program_target(dataset), *overrides)
    if options.launcher == "slurm":
        # An array task per rank: Slurm places the one-GPU tasks wherever GPUs are free.
        topology, finalize = derive_topology(options.gpus, gpus_per_node=1), FINALIZE_DEPENDENT
    else:
        topology, finalize = options.topology(), FINALIZE_IN_BAND
    plan = LaunchPlan("encode", dataset, options, topology, program, finalize=finalize)
    plan.resources = rank_resources(options, cfg.workers, ENCODE_BASE_GB, ENCODE_GB_PER_WORKER)
    if options.launcher == "slurm" and options.nodes:
        plan.notes.append("NODES is ignored for an encode array: Slurm packs the one-GPU tasks onto nodes")
    if options.launcher == "k8s" and not all(storage.is_s3(uri) for uri in (cfg.source.uri, cfg.output.uri)):
        plan.notes.append(
            "source.uri / output.uri are local paths: every pod needs them mounted (or use s3://)"
        )
    plan.steps = build_steps(plan, os.environ if environ is None else environ)
    return plan


@launch_command
def launch(
    dataset: Annotated[str, typer.Argument(help="a name in jobs/datasets/ or a YAML path")],
    overrides: OverridesArg = None,
    *,
    options: LaunchOptions,
) -> LaunchPlan:
    """Encode DATASET on GPUS ranks, then publish it once every rank is done (Slurm: a dependent job)."""
    return plan_encode(dataset, overrides or [], options)


launch_command = launch  # the name encode/cli.py registers
