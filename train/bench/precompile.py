"""Fill the bench's compile cache side by side before the timed sections (`precompile.workers`).

Cold, `make bench BENCH=full` compiles every shape it times one after another: the recipe at 256 and 512
px, each compiled anatomy variant at each, each aspect-ratio bucket, 158-230 s apiece on an H200 (torch
2.11, 16 cores), most of it one core tracing and lowering. Compiles of different graphs share nothing but
the cache folder, so child processes (`python -m train.bench.precompile CONFIG VARIANT RESOLUTION
[BUCKET]`) each build one of those steps exactly as the section will (anatomy/section.py `full_step`), run
it twice and exit, `workers` at a time, all into the cache folder the bench set (inherited through the
environment). The timed sections then load each graph from the cache (15 s a shape on the H200). Children's
times are not measurements: compiles side by side slow each other. A child that fails or runs out of time
is logged and skipped: the section then compiles that shape itself. The recipe as a run trains it
(trainer.as_recipe: Composer's trainer, FSDP per block) is a unit too, at each of its resolutions: its child
runs that section's own code for a few batches. The VAE still compiles in its section.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from shared.config import config_to_dict
from shared.presets import get_preset
from shared.runtime.children import die_with_parent
from shared.runtime.device import DeviceSetup
from train.bench.config import BenchConfig, load_bench_config, load_recipe
from train.bench.data import write_synthetic_dataset
from train.bench.trainer.as_recipe import as_recipe_overrides, as_recipe_rows, bench_as_recipe
from train.config import TrainConfig
from train.model.compile_plan import use_compile

RECIPE = "recipe"  # the unit of the recipe itself (the train section's step)
POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Unit:
    variant: str  # RECIPE, an anatomy variant's name, or a run of the recipe as run (as_recipe_overrides)
    resolution: int
    bucket: str = ""  # an aspect-ratio bucket's "HxW" (the buckets section's step), "" for the square

    @property
    def name(self) -> str:
        return f"{self.variant}-{self.bucket or self.resolution}"


def precompile_units(
    cfg: BenchConfig,
    recipe_with: Callable[[list[str]], TrainConfig],
    kind: str,
    as_runs: dict[str, TrainConfig] | None = None,
) -> list[Unit]:
    """The recipe and every anatomy variant that compiles, at each step resolution; then the recipe at each
    bucket of the buckets section that is not one of those squares; then each of `as_runs` (the recipe as
    the train job loads it, and its variants, by run name) that compiles, at each trainer.as_recipe
    resolution."""
    runs = {RECIPE: [], **(cfg.anatomy.variants if cfg.anatomy.enabled else {})}
    compiled = [name for name, extra in runs.items() if use_compile(recipe_with(list(extra)), kind)]
    units = [Unit(name, res) for name in compiled for res in cfg.step.resolutions]
    if cfg.buckets.enabled and RECIPE in compiled:
        res, batch = cfg.bucket_resolution(), cfg.bucket_batch()
        square = f"{res}x{res}" if res in cfg.step.resolutions and batch == cfg.step.batch_for(res) else ""
        units += [Unit(RECIPE, res, name) for name in cfg.bucket_names() if name != square]
    for name, run in (as_runs or {}).items():
        if use_compile(run, kind):
            units += [Unit(name, res) for res in cfg.as_recipe_at()]
    return units


def worker_count(cfg: BenchConfig, setup: DeviceSetup) -> int:
    """`precompile.workers`, fewer where the GPU cannot hold that many children's steps."""
    workers = cfg.precompile.workers
    if setup.device.type == "cuda":
        import torch

        total_gb = torch.cuda.get_device_properties(setup.device).total_memory / 1e9
        workers = min(workers, max(1, int(total_gb // cfg.precompile.gb_per_worker)))
    return workers


def run_precompile(cfg: BenchConfig, units: list[Unit], workers: int, folder: Path) -> dict[str, Any]:
    """Each unit in a child process, `workers` at a time; what ran, failed and how long it all took."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "bench.yaml"
    children = dataclasses.replace(cfg, precompile=dataclasses.replace(cfg.precompile, workers=0))
    config.write_text(yaml.safe_dump(config_to_dict(children), sort_keys=False))
    start, pending = time.perf_counter(), list(units)
    running: dict[Unit, tuple[subprocess.Popen[bytes], float]] = {}
    failed: dict[str, str] = {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                unit = pending.pop(0)
                running[unit] = (_start(config, unit, folder / f"{unit.name}.log"), time.perf_counter())
            time.sleep(POLL_S)
            for unit, (proc, began) in list(running.items()):
                why = ""
                if proc.poll() is None:
                    if time.perf_counter() - began < cfg.precompile.timeout_s:
                        continue
                    proc.kill()
                    proc.wait()
                    why = f"stopped after {cfg.precompile.timeout_s} s"
                elif proc.returncode:
                    why = f"exit {proc.returncode}"
                if why:
                    failed[unit.name] = f"{why} (log: {folder / f'{unit.name}.log'})"
                del running[unit]
    finally:
        for proc, _ in running.values():  # the bench itself stopped: no child outlives it
            proc.kill()
            proc.wait()
    return {
        "workers": workers,
        "units": [u.name for u in units],
        "seconds": time.perf_counter() - start,
        "failed": failed,
    }


def _start(config: Path, unit: Unit, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "train.bench.precompile", str(config), unit.variant]
    command += [str(unit.resolution), *([unit.bucket] if unit.bucket else [])]
    # the child's temp files (torch.compile's own) inside the bench's scratch, which the bench removes
    tmp = config.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    with log.open("wb") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=os.environ | {"TMPDIR": str(tmp)},
            preexec_fn=die_with_parent,  # a bench killed with -9 leaves no compile running
        )


def compile_unit(cfg: BenchConfig, unit: Unit, work: Path) -> float:
    """The child's work: the step the section will time, built the same way, run twice (compile, then the
    first replay, where a CUDA-graph variant records). Returns its seconds. `work`: the bench's precompile
    folder (the recipe names a save folder in it; nothing is written there)."""
    import torch

    from shared.buckets import parse_bucket
    from shared.runtime.device import resolve_device_setup
    from train.bench.anatomy.section import full_step
    from train.model.assemble import use_channels_last

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    setup = resolve_device_setup(cfg.device, cfg.precision, channels_last=False)
    # the layout from the recipe, as the bench resolves it once for every section and variant
    base = load_recipe(cfg, setup, work)
    setup = dataclasses.replace(setup, channels_last=use_channels_last(base, setup.kind))
    start = time.perf_counter()
    as_runs = as_recipe_overrides(cfg.trainer.as_recipe_variants)
    if unit.variant in as_runs:
        _run_as_recipe(cfg, setup, as_runs[unit.variant], unit.resolution, work / unit.name)
        return time.perf_counter() - start
    recipe = load_recipe(cfg, setup, work, list(cfg.anatomy.variants.get(unit.variant, [])))
    if unit.bucket:
        batch, bucket = cfg.bucket_batch(), parse_bucket(unit.bucket)
    else:
        batch, bucket = cfg.step.batch_for(unit.resolution), None
    step = full_step(recipe, setup, unit.resolution, batch, cfg.seed, bucket)
    step.run()
    step.run()
    setup.sync()
    return time.perf_counter() - start


def _run_as_recipe(
    cfg: BenchConfig, setup: DeviceSetup, extra: list[str], resolution: int, work: Path
) -> None:
    """trainer.as_recipe's own run (`extra`: a variant's overrides) at `resolution`, a few batches, over a
    dataset of its own."""
    as_run = load_recipe(cfg, setup, work, extra, one_device=False)
    root = work / "data"
    rows = as_recipe_rows(cfg.loader.rows, as_run.device_microbatch_size)
    write_synthetic_dataset(root, get_preset(cfg.preset), resolution, rows, cfg.seed)
    bench_as_recipe(as_run, root, resolution, 1, 1, work / "run", setup, flops_per_image=0.0, peak=None)


def main(argv: list[str]) -> int:
    config, variant, resolution, *bucket = argv
    cfg = load_bench_config(config)
    unit = Unit(variant, int(resolution), *bucket)
    seconds = compile_unit(cfg, unit, Path(config).parent)
    print(f"precompiled {unit.variant} at {unit.bucket or unit.resolution} px in {seconds:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
