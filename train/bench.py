"""`make bench` / `python -m train bench [CONFIG] [key=value ...]`: throughput, FLOPs and MFU on this device.

One process measures, on synthetic inputs of the preset's exact shapes (warm-up excluded, medians of repeats):
- flops:   FLOPs per image of the U-Net forward and train step, VAE encoder and text tower (FlopCounterMode),
           and the ideal offline speedup they imply;
- train:   per resolution, the train job's step on precomputed latents (images/s per device, MFU) and the
           online baseline that encodes pixels and captions inside the step -> the measured offline speedup;
- loader:  train's real StreamingDataLoader over a real MDS dataset on disk, vs the step and vs a raw read;
- trainer: the real Composer trainer (EMA, clipping, callbacks, logging) vs the bare step on its own model;
- encode:  the real encode pipeline on sample data vs its stages alone.

Writes `<out_dir>/bench.json` (train/estimate.py reads it: `make estimate ARGS='throughput_from=...'`) and
`<out_dir>/bench.md`. Configs: jobs/bench/*.yaml (quick: tiny preset, minutes on a laptop CPU; full: SD2
base on a GPU; sd2-base-cpu: SD2 base at batch 1 on CPU). Step code: train/bench_step.py; loader and
trainer: train/bench_data.py; encode: train/bench_encode.py.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import typer

from shared.config import ConfigError, config_to_dict, load_config
from shared.presets import get_preset

if TYPE_CHECKING:
    from train.bench_step import DeviceSetup
    from train.config import TrainConfig

DEFAULT_CONFIG = "quick"
JSON_NAME = "bench.json"
MARKDOWN_NAME = "bench.md"
# Below these the findings call a part of the product out as not close to its limit.
LOADER_HEADROOM = 2.0  # loader images/s over train-step images/s
NEAR_LIMIT = 0.8  # share of a bound (encode pipeline vs its slowest stage, offline speedup vs ideal)
HOST_WORK_SHARE = 0.05  # host-side work on a device's critical path (Objective.prepare, VAE input prep)
OUTSIDE_SHARE = 0.10  # Composer's time outside the bare step
LISTED_COMPONENTS = 3  # the costliest Composer algorithms / callbacks named in the findings


# ------------------------------------------------------------------------------------------------ config
@dataclass
class StepBenchConfig:
    resolutions: list[int] = field(default_factory=lambda: [256, 512])  # px; the planner needs 256 and 512
    batch_size: int = 4  # per device
    batch_size_by_resolution: dict[str, int] = field(default_factory=dict)  # e.g. {512: 16}; else batch_size
    warmup: int = 1  # untimed steps first (allocator, autotuning, lazy optimizer state)
    repeats: int = 3  # timed steps; the median is reported
    online: bool = True  # also time the on-the-fly-encoding baseline (-> offline speedup)
    channels_last: bool = True  # GPU only

    def batch_for(self, resolution: int) -> int:
        return int(self.batch_size_by_resolution.get(str(resolution), self.batch_size))


@dataclass
class LoaderBenchConfig:
    enabled: bool = True
    resolution: int = 0  # 0: the first of step.resolutions (the trainer section uses the same dataset)
    rows: int = 256  # rows written at the preset's shapes
    batch_size: int = 0  # 0: the step's batch size at that resolution
    num_workers: int = 2
    passes: int = 2  # the first pass copies shards into the local cache; later passes read it warm
    raw_read_repeats: int = 3


@dataclass
class TrainerBenchConfig:
    enabled: bool = True
    batches: int = 8  # timed Composer batches (after warmup)
    warmup: int = 2


@dataclass
class EncodeBenchConfig:
    enabled: bool = True
    dataset: str = "sample"  # jobs/datasets config whose filter, caption and transform settings apply
    resolutions: list[int] = field(default_factory=lambda: [64, 128])
    # 0: the bundled sample data (encode/sample_data.py, images 24-288 px); else synthetic photos with this
    # shorter side (4:3), e.g. 320 to feed 256 px.
    source_short_side: int = 0
    samples: int = 128  # source samples, spread over `partitions` tars
    partitions: int = 2
    batch_size: int = 32
    workers: int = 1  # decode/resize processes beside the models
    repeats: int = 1


@dataclass
class BenchConfig:
    name: str = "bench"
    preset: str = "tiny"  # shared/presets.py: the shapes measured
    recipe: str = "tiny"  # jobs/train config whose model recipe, optimizer, EMA and logging are timed
    device: Literal["auto", "cpu", "gpu"] = "auto"
    precision: Literal["auto", "fp32", "amp_bf16"] = "auto"  # auto: amp_bf16 on GPU, fp32 on CPU (as train)
    # Peak TFLOP/s of one device for MFU; None: the GPU's bf16 dense peak from train/estimate.py's GPU_TABLE
    # (A100 312, H100 / H200 989), n/a on CPU unless given.
    peak_tflops: float | None = None
    seed: int = 0
    # torch intra-op threads in this process; 0: torch's default (one per core). On a shared CPU, 1 avoids
    # the stalls multi-threaded kernels take whenever another process holds one of their cores.
    threads: int = 0
    step: StepBenchConfig = field(default_factory=StepBenchConfig)
    loader: LoaderBenchConfig = field(default_factory=LoaderBenchConfig)
    trainer: TrainerBenchConfig = field(default_factory=TrainerBenchConfig)
    encode: EncodeBenchConfig = field(default_factory=EncodeBenchConfig)
    out_dir: str = "outputs/bench"
    work_dir: str = ""  # scratch for datasets and the trainer run; "": a temp folder, removed afterwards

    def __post_init__(self) -> None:
        try:
            preset = get_preset(self.preset)
            for res in [*self.step.resolutions, self.loader.resolution or self.step.resolutions[0]]:
                preset.latent_shape(res)
        except (ValueError, IndexError) as err:
            raise ConfigError(f"preset / step.resolutions: {err or 'step.resolutions is empty'}") from err
        step = self.step
        if step.repeats < 1 or step.warmup < 0 or any(step.batch_for(r) < 1 for r in step.resolutions):
            raise ConfigError("step.repeats and batch sizes must be >= 1, step.warmup >= 0")
        if self.loader.rows < 2 * self.loader_batch():
            raise ConfigError(
                f"loader.rows={self.loader.rows} must hold at least two batches of {self.loader_batch()}"
            )
        if self.trainer.warmup < 1 or self.trainer.batches < 1:
            raise ConfigError(
                "trainer.warmup and trainer.batches must be >= 1 (the first batch pays start-up)"
            )
        if self.encode.enabled and self.encode.samples < self.encode.partitions:
            raise ConfigError("encode.samples must be >= encode.partitions")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0: torch's default), got {self.threads}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"peak_tflops must be > 0 TFLOP/s, got {self.peak_tflops}")

    def data_resolution(self) -> int:
        return self.loader.resolution or self.step.resolutions[0]

    def loader_batch(self) -> int:
        return self.loader.batch_size or self.step.batch_for(self.data_resolution())


def load_bench_config(config: str | Path = DEFAULT_CONFIG, overrides: list[str] | None = None) -> BenchConfig:
    """`jobs/bench/<config>.yaml` (or a path) + `key=value` overrides."""
    return load_config(BenchConfig, config, overrides or [], kind="bench")


# --------------------------------------------------------------------------------------------- sections
def load_recipe(cfg: BenchConfig, setup: DeviceSetup, work: Path) -> TrainConfig:
    """The train recipe at the bench's preset, device and precision (single device: no FSDP)."""
    from train.config import TrainConfig

    overrides = [
        f"model.preset={cfg.preset}",
        f"data.resolution={cfg.data_resolution()}",
        f"save_folder={work / 'save'}",
        "fsdp=false",
        f"device={setup.kind}",
        f"precision={setup.precision}",
    ]
    return load_config(TrainConfig, cfg.recipe, overrides, kind="train")


def device_peak(cfg: BenchConfig, setup: DeviceSetup) -> tuple[float | None, str]:
    """(peak TFLOP/s of the device, where that number comes from)."""
    from train.estimate import GPU_TABLE, gpu_type_for_device

    if cfg.peak_tflops:
        return cfg.peak_tflops, "peak_tflops (config)"
    gpu = gpu_type_for_device(setup.name) if setup.kind == "gpu" else None
    if gpu:
        return GPU_TABLE[gpu].peak_bf16_tflops, f"{gpu} bf16 dense (train/estimate.py GPU_TABLE)"
    return None, "unknown: pass peak_tflops=<TFLOP/s of one device> for MFU"


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def _timed_section(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = time.perf_counter() - start
        _free_memory()


def bench_data_sections(
    cfg: BenchConfig, recipe: TrainConfig, setup: DeviceSetup, work: Path
) -> dict[str, Any]:
    """Loader and trainer sections over one real MDS dataset written at the preset's shapes."""
    from train.bench_data import (
        bench_loader,
        bench_trainer,
        raw_read_bytes_per_s,
        shard_files,
        write_synthetic_dataset,
    )

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
    if cfg.trainer.enabled:
        t = cfg.trainer
        out["trainer"] = bench_trainer(recipe, root, res, batch, t.batches, t.warmup, work / "trainer", setup)
        out["trainer"]["resolution"] = res
        out["trainer"]["recipe"] = cfg.recipe
    return out


def bench_encode_section(cfg: BenchConfig, setup: DeviceSetup, work: Path) -> dict[str, Any]:
    from train.bench_encode import bench_encode

    return bench_encode(cfg.encode, cfg.preset, setup, work / "encode", cfg.seed)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Every section in one process; returns the JSON-able result (see the module docstring)."""
    with _torch_threads(cfg.threads):
        return _run_sections(cfg)


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """Run with `threads` torch threads (0: leave as is), restoring the caller's count afterwards."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_sections(cfg: BenchConfig) -> dict[str, Any]:
    from train.bench_step import bench_train_steps, count_flops, resolve_device

    try:
        setup = resolve_device(cfg.device, cfg.precision, cfg.step.channels_last)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    peak, peak_source = device_peak(cfg, setup)
    timings: dict[str, float] = {}
    with _scratch(cfg.work_dir) as work:
        recipe = load_recipe(cfg, setup, work)
        with _timed_section(timings, "flops"):
            flops = count_flops(cfg.preset, sorted({*cfg.step.resolutions}))
        with _timed_section(timings, "train"):
            train = bench_train_steps(recipe, setup, cfg.step, flops, peak, cfg.seed)
        result: dict[str, Any] = {
            "device": setup.name,
            "device_type": setup.kind,
            "num_devices": 1,  # per-device numbers from one device, no gradient all-reduce
            "precision": setup.precision,
            "channels_last": setup.channels_last,
            "preset": cfg.preset,
            "recipe": cfg.recipe,
            "peak_tflops": peak,
            "peak_source": peak_source,
            "flops": {str(r): f.to_json() for r, f in flops.items()},
            "train": train,
        }
        if cfg.loader.enabled or cfg.trainer.enabled:
            with _timed_section(timings, "data"):
                result |= bench_data_sections(cfg, recipe, setup, work)
        if cfg.encode.enabled:
            with _timed_section(timings, "encode"):
                result["encode"] = bench_encode_section(cfg, setup, work)
    result["findings"] = findings(result)
    result["seconds_by_section"] = timings
    result["created"] = datetime.now(UTC).isoformat(timespec="seconds")
    result["config"] = config_to_dict(cfg)
    return result


@contextmanager
def _scratch(work_dir: str) -> Iterator[Path]:
    if work_dir:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
        yield Path(work_dir)
        return
    with tempfile.TemporaryDirectory(prefix="sd-bench-") as tmp:
        yield Path(tmp)


# -------------------------------------------------------------------------------------------- findings
def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def train_findings(train: dict[str, Any]) -> list[str]:
    notes = []
    for res, t in train.items():
        if "offline_speedup" in t:
            speedup, ideal = t["offline_speedup"], t["ideal_offline_speedup"]
            notes.append(
                f"{res} px: precomputing speeds the step up {speedup:.2f}x (ideal from FLOPs {ideal:.2f}x)"
            )
        if t["mfu"] is not None:
            notes.append(f"{res} px: offline step MFU {_pct(t['mfu'])} ({t['tflops_per_s']:.1f} TFLOP/s)")
        if t["prepare_share_of_step"] > HOST_WORK_SHARE:
            notes.append(
                f"{res} px: Objective.prepare (per-sample noise draws on the host) takes "
                f"{_pct(t['prepare_share_of_step'])} of the step"
            )
    return notes


def loader_findings(loader: dict[str, Any], step_rate: float) -> list[str]:
    headroom = loader["images_per_s"] / step_rate
    starve = " - too little headroom: the loader can starve the step" if headroom < LOADER_HEADROOM else ""
    per_sample_us = 1e6 * max(loader["num_workers"], 1) / loader["images_per_s"]
    read_share = loader["bytes_per_s"] / loader["raw_read_bytes_per_s"]
    return [
        f"loader {loader['images_per_s']:,.0f} img/s = {headroom:.1f}x the train step{starve}",
        f"loader costs {per_sample_us:,.0f} us of one worker per sample and moves "
        f"{loader['bytes_per_s'] / 1e6:,.1f} MB/s, {_pct(read_share)} of a raw read of the same shards: "
        "per-sample and per-batch work, not reading, sets its rate",
    ]


def trainer_findings(trainer: dict[str, Any]) -> list[str]:
    largest = sorted(trainer["components_s"].items(), key=lambda item: -item[1])[:LISTED_COMPONENTS]
    parts = ", ".join(f"{name} {1000 * s:.1f} ms" for name, s in largest)
    flag = " - above target" if trainer["outside_step_share"] > OUTSIDE_SHARE else ""
    return [
        f"Composer trainer: {_pct(trainer['outside_step_share'])} of each batch is outside the bare step"
        f"{flag} (data fetch {1000 * trainer['data_fetch_s']:.1f} ms; {parts}; Composer's own loop "
        f"{1000 * trainer['unattributed_s']:.1f} ms)"
    ]


def encode_findings(encode: dict[str, Any]) -> list[str]:
    flag = " - below its bound" if encode["share_of_bound"] < NEAR_LIMIT else ""
    notes = [
        f"encode pipeline {encode['images_per_s_per_device']:,.1f} samples/s = "
        f"{_pct(encode['share_of_bound'])} of its bound {encode['bound_samples_per_s']:,.1f} and "
        f"{_pct(encode['share_of_slowest_stage'])} of its slowest stage ({encode['slowest_stage']}){flag}"
    ]
    if encode["vae_input_share_of_vae"] > HOST_WORK_SHARE:
        notes.append(
            f"encode VAE stage: {_pct(encode['vae_input_share_of_vae'])} of it is host-side pixel conversion "
            "(uint8 -> float32 NCHW in the main process, before the copy to the device)"
        )
    return notes


def findings(result: dict[str, Any]) -> list[str]:
    """One line per place the numbers say something (speedup vs ideal, MFU, headroom, overheads)."""
    notes = train_findings(result["train"])
    if loader := result.get("loader"):
        notes += loader_findings(
            loader, result["train"][str(loader["resolution"])]["images_per_s_per_device"]
        )
    if trainer := result.get("trainer"):
        notes += trainer_findings(trainer)
    if encode := result.get("encode"):
        notes += encode_findings(encode)
    return notes


# ---------------------------------------------------------------------------------------------- outputs
def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown table lines; the first column left-aligned, the rest right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _train_table(result: dict[str, Any]) -> list[str]:
    header = [
        "res",
        "batch",
        "img/s offline",
        "img/s online",
        "speedup",
        "ideal",
        "U-Net step GFLOP/img",
        "MFU",
    ]
    rows = []
    for res, t in result["train"].items():
        online = t.get("online", {}).get("images_per_s_per_device")
        rows.append(
            [
                res,
                str(t["batch_size"]),
                _fmt(t["images_per_s_per_device"]),
                _fmt(online),
                _fmt(t.get("offline_speedup")),
                _fmt(t["ideal_offline_speedup"]),
                _fmt(result["flops"][res]["unet_train_step"] / 1e9, 1),
                "n/a" if t["mfu"] is None else f"{100 * t['mfu']:.1f}%",
            ]
        )
    return _table(header, rows)


def _pipeline_table(result: dict[str, Any]) -> list[str]:
    rows = []
    if loader := result.get("loader"):
        step = result["train"][str(loader["resolution"])]["images_per_s_per_device"]
        raw = loader["raw_read_bytes_per_s"] / 1e6
        rows.append(
            [
                f"loader ({loader['resolution']} px)",
                f"{_fmt(loader['images_per_s'], 1)} img/s",
                f"step {_fmt(step)} img/s",
            ]
        )
        rows.append(
            ["loader bytes", f"{_fmt(loader['bytes_per_s'] / 1e6, 1)} MB/s", f"raw read {_fmt(raw, 1)} MB/s"]
        )
    if trainer := result.get("trainer"):
        wall, bare = 1000 * trainer["wall_per_batch_s"], 1000 * trainer["bare_step_s"]
        rows.append(
            [
                f"Composer batch ({trainer['resolution']} px)",
                f"{_fmt(wall, 1)} ms",
                f"bare step {_fmt(bare, 1)} ms",
            ]
        )
    if encode := result.get("encode"):
        stages = ", ".join(f"{k} {_fmt(v, 1)}" for k, v in encode["stages_samples_per_s"].items())
        rate = f"{_fmt(encode['images_per_s_per_device'], 1)} samples/s"
        rows.append(
            ["encode pipeline", rate, f"alone: {stages}; bound {_fmt(encode['bound_samples_per_s'], 1)}"]
        )
    return _table(["part", "measured", "compared with"], rows) if rows else []


def render_markdown(result: dict[str, Any]) -> str:
    """The short tables: the step per resolution, then loader / trainer / encode, then the findings."""
    lines = [f"# Bench: {result['preset']} on {result['device']} ({result['precision']})", ""]
    lines += [*_train_table(result), ""]
    if pipeline := _pipeline_table(result):
        lines += [*pipeline, ""]
    lines += [f"- {note}" for note in result["findings"]]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / JSON_NAME, "md": out / MARKDOWN_NAME}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    paths["md"].write_text(render_markdown(result))
    return paths


# -------------------------------------------------------------------------------------------------- CLI
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
        result = run_bench(cfg)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    paths = write_outputs(result, cfg.out_dir)
    typer.echo(render_markdown(result))
    typer.echo("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":  # `python -m train.bench [CONFIG] [key=value ...]`
    typer.run(bench_command)
