"""Run every bench section in one process on whatever device is present; returns the JSON-able result."""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from encode.bench import ENCODER_PRECISION, bench_encode, bench_encoders
from encode.vae_speed import vae_speed
from shared.config import ConfigError, config_to_dict
from shared.estimate import GPU_TABLE, gpu_type_for_device
from shared.presets import get_preset
from shared.runtime.device import DeviceSetup, resolve_device_setup
from shared.runtime.environ import restored_environ
from train.bench.anatomy.buckets import bench_buckets
from train.bench.anatomy.section import bench_anatomy, bench_variants
from train.bench.config import BenchConfig, load_recipe
from train.bench.data import (
    bench_loader,
    bench_loader_vs_streaming,
    raw_read_bytes_per_s,
    shard_files,
    write_synthetic_dataset,
)
from train.bench.precompile import precompile_units, run_precompile, worker_count
from train.bench.report import findings, write_json
from train.bench.scale import bench_collectives
from train.bench.scale_s3 import S3_RUN_BATCH, bench_s3_requests
from train.bench.step import FlopCounts, bench_train_steps, count_flops, mfu, progress
from train.bench.text_store import bench_text_store
from train.bench.trainer.as_recipe import AS_RECIPE, as_recipe_overrides, as_recipe_rows, bench_as_recipe
from train.bench.trainer.batches import bench_trainer
from train.bench.trainer.host import bench_host_twin
from train.config import TrainConfig
from train.model.assemble import INDUCTOR_CACHE_ENV, TRITON_CACHE_ENV, use_channels_last, use_compile_cache
from train.resilience.signals import restores_signal_handlers

PYTHON_SIDE_TARGET = 0.05  # issue 11: under 5% of a step outside the U-Net forward/backward and optimizer


def device_peak(cfg: BenchConfig, setup: DeviceSetup) -> tuple[float | None, str]:
    """(peak TFLOP/s of the device, where that number comes from)."""
    if cfg.peak_tflops:
        return cfg.peak_tflops, "peak_tflops (config)"
    gpu = gpu_type_for_device(setup.name) if setup.kind == "gpu" else None
    if gpu:
        return GPU_TABLE[gpu].peak_bf16_tflops, f"{gpu} bf16 dense (shared/estimate GPU_TABLE)"
    return None, "unknown: pass peak_tflops=<TFLOP/s of one device> for MFU"


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def _timed_section(timings: dict[str, float], name: str) -> Iterator[None]:
    start, ended = time.perf_counter(), "stopped after"
    progress(f"{name} ...")
    try:
        yield
        ended = "done in"
    finally:
        timings[name] = time.perf_counter() - start
        progress(f"{name}: {ended} {timings[name]:.1f} s")
        _free_memory()


def bench_data_sections(
    cfg: BenchConfig,
    recipe: TrainConfig,
    setup: DeviceSetup,
    work: Path,
    flops: dict[int, FlopCounts],
    peak: float | None,
    as_runs: dict[str, TrainConfig] | None = None,
) -> dict[str, Any]:
    """Loader and trainer sections over one real MDS dataset written at the preset's shapes; `as_runs`:
    the recipe as the train job loads it and its variants (by run name), for trainer.as_recipe."""
    res, batch = cfg.data_resolution(), cfg.loader_batch()
    root = work / "dataset"
    manifest = write_synthetic_dataset(root, get_preset(cfg.preset), res, cfg.loader.rows, cfg.seed)
    out: dict[str, Any] = {}
    if cfg.loader.enabled:
        loader = cfg.loader
        out["loader"] = bench_loader(
            root, res, batch, loader.num_workers, loader.passes, work / "loader-cache", cfg.seed
        )
        raw, total = raw_read_bytes_per_s(shard_files(root, res), loader.raw_read_repeats)
        bytes_per_row = manifest.resolutions[res].bytes / manifest.num_samples(res)
        out["loader"] |= {
            "resolution": res,
            "bytes_per_row": bytes_per_row,
            "bytes_per_s": out["loader"]["images_per_s"] * bytes_per_row,
            "raw_read_bytes_per_s": raw,
            "shard_bytes": total,
        }
        out["loader_vs_streaming"] = loader_vs_streaming(cfg, root, work)
    if cfg.trainer.enabled:
        t = cfg.trainer
        out["trainer"] = bench_trainer(
            recipe, root, res, batch, t.batches, t.warmup, work / "trainer", setup, t.flow_batches
        )
        out["trainer"]["resolution"] = res
        out["trainer"]["recipe"] = cfg.recipe
        if as_runs:
            out["trainer"] |= as_recipe_section(cfg, as_runs, setup, work, root, flops, peak)
        if t.host_twin:
            out["trainer"]["host_twin"] = bench_host_twin(cfg, setup, work)
    return out


def as_recipe_section(
    cfg: BenchConfig,
    as_runs: dict[str, TrainConfig],
    setup: DeviceSetup,
    work: Path,
    data_root: Path,
    flops: dict[int, FlopCounts],
    peak: float | None,
) -> dict[str, Any]:
    """The recipe as a run of it trains (`as_recipe`), and each of its variants (`as_recipe_variants`, by
    name, with their overrides), at each trainer.as_recipe resolution, over the data sections' dataset where
    it fits, else one of their own."""
    t = cfg.trainer
    variants = t.as_recipe_variants
    out: dict[str, Any] = {"as_recipe": {}, **({"as_recipe_variants": {}} if variants else {})}
    datasets: dict[tuple[int, int], Path] = {(cfg.data_resolution(), cfg.loader.rows): data_root}

    def dataset(res: int, rows: int) -> Path:
        if (res, rows) not in datasets:
            datasets[res, rows] = work / f"dataset-{res}-{rows}"
            write_synthetic_dataset(datasets[res, rows], get_preset(cfg.preset), res, rows, cfg.seed)
        return datasets[res, rows]

    for res in cfg.as_recipe_at():
        for name, run in as_runs.items():
            progress(f"trainer as {cfg.recipe} runs it at {res} px ({name}: its FSDP and microbatch) ...")
            root = dataset(res, as_recipe_rows(cfg.loader.rows, run.device_microbatch_size))
            entry = bench_as_recipe(
                run, root, res, t.warmup, t.flow_batches, work / f"{name}-{res}", setup,
                flops[res].unet_train_step, peak,
            )  # fmt: skip
            if name == AS_RECIPE:
                out["as_recipe"][str(res)] = entry
            else:
                short = name.removeprefix(f"{AS_RECIPE}.")
                entry["overrides"] = list(variants[short])
                out["as_recipe_variants"].setdefault(short, {})[str(res)] = entry
    return out


def loader_vs_streaming(cfg: BenchConfig, root: Path, work: Path) -> dict[str, Any]:
    """Train's loader against plain StreamingDataset over the same shards: one dataset, and a two-stream
    data.streams mix (the second dataset written like the first, other rows)."""
    res, batch, loader = cfg.data_resolution(), cfg.loader_batch(), cfg.loader
    second = work / "dataset-2"
    write_synthetic_dataset(second, get_preset(cfg.preset), res, loader.rows, cfg.seed + 1)
    args = (res, batch, loader.num_workers, loader.passes)
    return {
        "one_stream": bench_loader_vs_streaming([root], *args, work / "vs-one", cfg.seed),
        "two_streams": bench_loader_vs_streaming([root, second], *args, work / "vs-mix", cfg.seed),
    }


def anatomy_section(
    cfg: BenchConfig,
    recipe: TrainConfig,
    setup: DeviceSetup,
    work: Path,
    flops: dict[int, Any],
    peak: float | None,
) -> dict[str, Any]:
    """Where the step's time goes, and each anatomy.variants switch's own gain (train/bench/anatomy/)."""
    out = bench_anatomy(cfg, recipe, setup)
    if cfg.anatomy.variants:
        with_overrides = lambda extra: load_recipe(cfg, setup, work, extra)  # noqa: E731
        out["variants"] = bench_variants(cfg, recipe, setup, with_overrides, flops, peak)
        out["baseline"] = cfg.anatomy.baseline
    return out


def precompile_section(
    cfg: BenchConfig, setup: DeviceSetup, work: Path, as_runs: dict[str, TrainConfig]
) -> dict[str, Any]:
    """The recipe, the compiled anatomy variants and the recipe as run compiled side by side into the cache
    the sections then load from (train/bench/precompile.py)."""
    recipe_with = lambda extra: load_recipe(cfg, setup, work, extra)  # noqa: E731
    units = precompile_units(cfg, recipe_with, setup.kind, as_runs)
    workers = worker_count(cfg, setup)
    if workers < 2 or not units:  # one at a time is what the sections do anyway
        names = [u.name for u in units]
        return {"workers": workers, "units": names, "skipped": "fewer than 2 workers or units"}
    progress(f"precompile: {len(units)} steps, {workers} at a time (their times are not measurements) ...")
    return run_precompile(cfg, units, workers, work / "precompile")


def scale_section(trainer: dict[str, Any]) -> dict[str, Any]:
    """Counters that must not grow with the cluster (issue 11), from the real Composer run: the share of
    each batch spent outside its U-Net forward/backward (with the objective's device work) and optimizer
    step, timed inside the batch (target < 5%), and host read-backs per step (0)."""
    reads = trainer["host_reads_per_step"]
    return {
        "python_side_share": trainer["python_side_share"],
        "python_side_share_target": PYTHON_SIDE_TARGET,
        "host_syncs_per_step": {"train": reads["train"]["median"], "composer": reads["composer"]["median"]},
        "host_sync_places": reads["composer_places"],
    }


def scale_counters(cfg: BenchConfig, work: Path) -> dict[str, Any]:
    """The scale section's counters beyond the trainer's (issue 11): S3 requests per step outside checkpoint
    steps (train/bench/scale_s3.py), and from one 2-rank job the EMA update's bytes, the collectives of an
    optimizer step at the shipped SD2 settings and checkpoint cost, full vs sharded (train/bench/scale.py)."""
    scale = cfg.scale
    out: dict[str, Any] = {}
    if scale.s3:
        batches, interval = scale.s3_batches, scale.s3_checkpoint_interval
        out["s3"] = bench_s3_requests(work / "scale", S3_RUN_BATCH, batches, interval)
    if scale.collectives:
        out["comm"] = bench_collectives(scale.ckpt_width, scale.ckpt_depth, scale.ckpt_repeats)
    return out


def bench_encode_section(
    cfg: BenchConfig, setup: DeviceSetup, work: Path, flops: dict[int, Any], peak: float | None
) -> dict[str, Any]:
    out = bench_encode(cfg.encode, cfg.preset, setup, work / "encode", cfg.seed)
    plan = cfg.encode
    if plan.vae_resolutions:
        vae = bench_encoders(cfg.preset, setup).vae
        speed = vae_speed(
            vae, plan.vae_resolutions, plan.vae_batch_size, plan.repeats + 1, ENCODER_PRECISION, setup,
            plan.vae_compile,
        )  # fmt: skip
        for res, runs in speed.items():
            for run in runs.values():
                run["mfu"] = mfu(flops[int(res)].vae_encoder, run["images_per_s"], peak)
        out["vae"] = speed
    return out


@restores_signal_handlers  # Composer binds SIGTERM/SIGINT at import and in fit (train/resilience/signals.py)
def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Every section in one process; returns the JSON-able result (see the module docstring)."""
    with _torch_threads(cfg.threads):
        return _run_sections(cfg)


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """Run with `threads` torch threads (0: leave as is), restoring the caller's count afterwards."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_sections(cfg: BenchConfig) -> dict[str, Any]:
    try:
        setup = resolve_device_setup(cfg.device, cfg.precision, channels_last=False)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    peak, peak_source = device_peak(cfg, setup)
    timings: dict[str, float] = {}
    result: dict[str, Any] = {"complete": False}
    partial = PartialResult(cfg.out_dir, result, timings)
    with _scratch(cfg.work_dir) as work:
        recipe = load_recipe(cfg, setup, work)
        # loaded here, so a bad override stops the bench at its start, not an hour in
        as_runs = {
            name: load_recipe(cfg, setup, work, extra, one_device=False)
            for name, extra in as_recipe_overrides(cfg.trainer.as_recipe_variants).items()
        } if cfg.as_recipe_at() else {}  # fmt: skip
        # The layout is the recipe's train config switch, resolved as the train job resolves it.
        setup = dataclasses.replace(setup, channels_last=use_channels_last(recipe, setup.kind))
        with partial.section("flops"):
            counted = {*cfg.step.resolutions, *cfg.step.text_store_at(), *cfg.encode.vae_resolutions}
            counted |= {cfg.data_resolution(), *cfg.as_recipe_at()}  # the trainer's and as_recipe's MFU
            flops = count_flops(cfg.preset, sorted(counted))
        if cfg.precompile.workers:
            with partial.section("precompile"):
                result["precompile"] = precompile_section(cfg, setup, work, as_runs)
        with partial.section("train"):
            train = bench_train_steps(recipe, setup, cfg.step, flops, peak, cfg.seed)
        result |= {
            "device": setup.name,
            "device_type": setup.kind,
            "num_devices": 1,  # per-device numbers from one device, no gradient all-reduce
            "precision": setup.precision,
            "channels_last": setup.channels_last,
            "preset": cfg.preset,
            "recipe": cfg.recipe,
            "recipe_overrides": cfg.recipe_overrides,
            "peak_tflops": peak,
            "peak_source": peak_source,
            "flops": {str(r): f.to_json() for r, f in flops.items()},
            "train": train,
        }
        if cfg.anatomy.enabled:
            with partial.section("anatomy"):
                result["anatomy"] = anatomy_section(cfg, recipe, setup, work, flops, peak)
        if cfg.buckets.enabled:
            with partial.section("buckets"):
                result["buckets"] = bench_buckets(cfg, recipe, setup, work)
        if cfg.step.text_store_at():
            with partial.section("text_store"):
                result["text_store"] = bench_text_store(recipe, setup, cfg.step, flops, cfg.seed)
        if cfg.loader.enabled or cfg.trainer.enabled:
            with partial.section("data"):
                result |= bench_data_sections(cfg, recipe, setup, work, flops, peak, as_runs)
        if cfg.encode.enabled:
            with partial.section("encode"):
                result["encode"] = bench_encode_section(cfg, setup, work, flops, peak)
        counters: dict[str, Any] = {}
        if cfg.scale.s3 or cfg.scale.collectives:
            with partial.section("scale"):
                counters = scale_counters(cfg, work)
    scale = scale_section(result["trainer"]) if "trainer" in result else {}
    if scale or counters:
        result["scale"] = scale | counters
    result["findings"] = findings(result)
    result["seconds_by_section"] = timings
    result["created"] = datetime.now(UTC).isoformat(timespec="seconds")
    result["config"] = config_to_dict(cfg)
    result["complete"] = True
    return result


@dataclass
class PartialResult:
    """The sections measured so far, written to `<out_dir>/bench.json` as each section starts (`complete:
    false`, `running`: that section; the CLI overwrites it with the whole result at the end). A bench
    stopped at a time limit, as the bounded GPU check stops it, or failing in a later section, still
    leaves the numbers it had, and says where it stopped."""

    out_dir: str
    result: dict[str, Any]
    timings: dict[str, float]

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.write(running=name)
        with _timed_section(self.timings, name):
            yield

    def write(self, running: str) -> None:
        write_json(self.result | {"running": running, "seconds_by_section": self.timings}, self.out_dir)


@contextmanager
def _scratch(work_dir: str) -> Iterator[Path]:
    if work_dir:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
        with _compile_cache_in(Path(work_dir) / "compile-cache"):
            yield Path(work_dir)
        return
    with (
        tempfile.TemporaryDirectory(prefix="sd-bench-") as tmp,
        _compile_cache_in(Path(tmp) / "compile-cache"),
    ):
        yield Path(tmp)


@contextmanager
def _compile_cache_in(folder: Path) -> Iterator[None]:
    """Inductor's (and Triton's) caches in the bench's scratch folder, unless the environment names one
    (`make test-gpu` does, so its second run is faster): by default they go to <temp>/torchinductor_<user>,
    which the bench would leave behind. The environment is the caller's again afterwards."""
    if os.environ.get(INDUCTOR_CACHE_ENV):
        yield
        return
    with restored_environ((INDUCTOR_CACHE_ENV, TRITON_CACHE_ENV)):
        use_compile_cache(str(folder))
        yield
