"""Encode side of `make bench` (`python -m train bench` runs it; nothing here imports train): the real encode
pipeline (`encode.pipeline.run_rank`) on sample data, and each
of its stages alone on the same samples, to show how close the pipeline gets to its slowest stage.

Stages: the worker side (read, filter, decode, resize: `encode.process.prepare.prepare_partition`, one
process), the VAE (every resolution of a sample) and the text tower. VAE and text run one after the other in
the main process while workers prepare the next samples, so the pipeline can at best reach min(workers x
worker rate, 1 / (VAE + text seconds per sample)).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.config.values import allowed
from shared.presets import random_init

if TYPE_CHECKING:
    from encode.config import EncodeConfig
    from encode.process.encoders import Encoders
    from encode.process.prepare import PreparedSample
    from shared.runtime.device import DeviceSetup

# torch and the encode pipeline are imported inside the functions that use them: train's bench config
# imports this module (for EncodeBenchConfig) whenever `python -m train` starts, and must stay light.
SOURCE_ASPECT = 4 / 3  # landscape photos: the long side is 4/3 of the short one (LAION's most common shape)
ENCODER_PRECISION = "fp16"  # encode's default GPU inference precision (CPU always runs fp32)
LATENT_PRECISION_IMAGES = 64  # images of the largest resolution the latent precision check encodes


@dataclass
class EncodeBenchConfig:
    enabled: bool = True
    dataset: str = "sample"  # jobs/datasets config whose filter, caption and transform settings apply
    resolutions: list[int] = allowed(default_factory=lambda: [64, 128], ge=8)
    # 0: the bundled sample data (encode/sample_data.py, images 24-288 px); else synthetic photos with this
    # shorter side (4:3), e.g. 320 to feed 256 px.
    source_short_side: int = 0
    samples: int = allowed(128, ge=1)  # source samples, spread over `partitions` tars
    partitions: int = allowed(2, ge=1)
    batch_size: int = allowed(32, ge=1)
    workers: int = 1  # decode/resize processes beside the models
    repeats: int = allowed(1, ge=1)
    # The VAE encoder alone at these resolutions (px; []: skipped), as built and with each speed switch
    # (encode/vae_speed.py): images/s, MFU, error over the posterior std
    vae_resolutions: list[int] = allowed(default_factory=list, ge=8)
    vae_batch_size: int = allowed(8, ge=1)
    vae_compile: bool = False  # also the compiled encoder (inductor: minutes of C++ compiling on CPU)
    # The encode job's speed switches for the pipeline and its stages, e.g. [encoder.compile=true,
    # encoder.low_precision_norms=true] as jobs/datasets/laion400m.yaml ships them
    encoder_overrides: list[str] = allowed(default_factory=list)


# ----------------------------------------------------------------------------------------------- sources
def build_source(out_dir: Path, plan: EncodeBenchConfig, seed: int) -> Path:
    """img2dataset-style tars of synthetic photos: the sample data's mix of sizes, or all one size."""
    from encode.sample_data import build_webdataset

    size = None
    if plan.source_short_side:
        size = (round(plan.source_short_side * SOURCE_ASPECT), plan.source_short_side)
    per_shard = -(-plan.samples // plan.partitions)
    build_webdataset(out_dir, shards=plan.partitions, per_shard=per_shard, seed=seed, size=size)
    return out_dir


# ---------------------------------------------------------------------------------------------- encoders
def bench_encoders(preset_name: str, setup: DeviceSetup, cfg: EncodeConfig | None = None) -> Encoders:
    """The preset's VAE and text tower, random-initialised, placed as
    `encode.process.encoders.load_encoders` does, and with `cfg`'s encoder switches and batch as it applies
    them (none: the VAE as built)."""
    import torch

    from encode.plan.fingerprints import EncoderIds
    from encode.process.encoders import Encoders, apply_encoder_switches
    from shared.models import build_text_encoder, build_vae
    from shared.presets import get_preset

    preset = random_init(get_preset(preset_name))
    vae = build_vae(preset).to(setup.device)
    if setup.channels_last:
        vae.to(memory_format=torch.channels_last)
    text = build_text_encoder(preset, "transformers").to(setup.device)
    ids = EncoderIds(vae="bench-random-init", text="bench-random-init", tokenizer="bench-random-init")
    encoders = Encoders(preset, vae, text, setup.device, ENCODER_PRECISION, ids)
    return encoders if cfg is None else apply_encoder_switches(encoders, cfg)


def encode_config(
    plan: EncodeBenchConfig, preset_name: str, source: Path, output: Path, setup: DeviceSetup
) -> EncodeConfig:
    from encode.config import EncodeConfig
    from shared.config import load_config

    overrides = [
        f"source.uri={source}",
        f"output.uri={output}",
        f"preset={preset_name}",
        f"transform.resolutions=[{','.join(str(r) for r in plan.resolutions)}]",
        f"filter.min_size={min(plan.resolutions)}",
        f"encoder.batch_size={plan.batch_size}",
        f"encoder.device={setup.device}",
        f"encoder.precision={ENCODER_PRECISION}",
        f"workers={plan.workers}",
        "progress=false",
        *plan.encoder_overrides,
    ]
    return load_config(EncodeConfig, plan.dataset, overrides, kind="datasets")


# ------------------------------------------------------------------------------------------------ stages
def prepare_all(cfg: EncodeConfig, encoders: Encoders) -> tuple[list[PreparedSample], float]:
    """The worker stage alone, in this process: every kept sample of every partition, and the seconds."""
    from encode.plan.fingerprints import plan_partitions, stage_fingerprints
    from encode.process.prepare import PreparedSample, prepare_partition
    from encode.sources import list_partitions
    from shared.manifest import Layout

    plans = plan_partitions(
        list_partitions(cfg.source), stage_fingerprints(cfg, encoders.ids), Layout(cfg.output.uri), {}
    )
    start = time.perf_counter()
    samples = [item for p in plans for item in prepare_partition(p, cfg) if isinstance(item, PreparedSample)]
    return samples, time.perf_counter() - start


def _batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _time_batches(
    run: Callable[[Sequence[Any]], Any], items: Sequence[Any], size: int, sync: Callable[[], None]
) -> float:
    """Seconds to run every batch, after one untimed warm-up batch."""
    if not items:
        return 0.0
    run(items[:size])
    sync()
    start = time.perf_counter()
    for batch in _batches(items, size):
        run(batch)
    sync()
    return time.perf_counter() - start


@dataclass(frozen=True)
class StageRun:
    kept: int  # samples that passed the filters
    seconds: dict[str, float]  # stage -> seconds over all kept samples
    vae_input_s: float  # of `vae`: stacking the uint8 pixels into one host batch, before the device


def time_stages(
    cfg: EncodeConfig, encoders: Encoders, plan: EncodeBenchConfig, setup: DeviceSetup
) -> StageRun:
    """Each stage alone over every kept sample: prepare (one process), VAE (all resolutions), text."""
    samples, prepare_s = prepare_all(cfg, encoders)
    vae_s = vae_input_s = 0.0
    for res in plan.resolutions:
        pixels = [s.pixels[res] for s in samples if res in s.pixels]
        vae_s += _time_batches(encoders.encode_images, pixels, plan.batch_size, setup.sync)
        vae_input_s += _time_batches(_model_input_batch, pixels, plan.batch_size, setup.sync)
    captions = [s.text_input for s in samples]
    text_s = _time_batches(encoders.encode_text, captions, plan.batch_size, setup.sync)
    return StageRun(len(samples), {"prepare": prepare_s, "vae": vae_s, "text": text_s}, vae_input_s)


def _model_input_batch(pixels: Sequence[np.ndarray]) -> Any:
    """The host-side part of `Encoders.encode_images`: uint8 HWC images -> one uint8 NHWC batch."""
    from encode.process.encoders import host_pixel_batch

    return host_pixel_batch(pixels, pin=False)


# ---------------------------------------------------------------------------------------------- pipeline
@dataclass(frozen=True)
class PipelineRun:
    seconds: float
    samples: int
    main_thread: dict[str, float]  # encode.process.timing.MainThreadTimes: seconds by phase
    launch: dict[str, float]  # ... and the launch phase's seconds by part
    device: dict[str, float]  # encode.process.timing.DeviceTimeline: busy and idle seconds
    vae_input_shapes: int  # distinct shapes the VAE ran on in this run (Encoders.vae_input_shapes)


def time_pipeline(cfg: EncodeConfig, encoders: Encoders) -> PipelineRun:
    """One `run_rank` into a fresh output (nothing to reuse): its seconds, the samples it encoded and where
    its main thread's time went."""
    from encode.pipeline import RankInfo, run_rank
    from encode.sources import list_partitions

    before = encoders.texts_encoded
    encoders.vae_input_shapes.clear()
    summary = run_rank(cfg, RankInfo(0, 1), encoders, list_partitions(cfg.source))
    if summary.failed:
        raise RuntimeError(f"encode bench: partitions failed: {summary.failed}")
    # each kept caption is encoded once
    return PipelineRun(
        summary.seconds,
        encoders.texts_encoded - before,
        summary.main_thread,
        summary.main_thread_launch,
        summary.device,
        len(encoders.vae_input_shapes),
    )


def bench_encode(
    plan: EncodeBenchConfig, preset_name: str, setup: DeviceSetup, work: Path, seed: int
) -> dict[str, Any]:
    """Samples/s of the real pipeline vs each stage alone, alternating them each repeat so both see the same
    machine load; `images_per_s_per_device` is what the planner reads (samples encoded per second, every
    resolution of a sample included)."""
    import torch

    from encode.process.encoders import encode_kernel_settings

    source = build_source(work / "source", plan, seed)
    stage_cfg = encode_config(plan, preset_name, source, work / "stages", setup)
    encoders = bench_encoders(preset_name, setup, stage_cfg)
    stages, pipeline = [], []
    # the encode job's cuDNN settings, not the ones the bench's train sections left behind
    with encode_kernel_settings(stage_cfg.encoder.compile, setup.device):
        autotuned = bool(torch.backends.cudnn.benchmark)
        for repeat in range(max(plan.repeats, 1)):
            stages.append(time_stages(stage_cfg, encoders, plan, setup))
            run_cfg = encode_config(plan, preset_name, source, work / f"encoded-{repeat}", setup)
            pipeline.append(time_pipeline(run_cfg, encoders))
    samples, kept = pipeline[0].samples, stages[0].kept
    if not samples or not kept:
        raise ValueError(
            "encode bench: no sample passed the filters; raise encode.source_short_side or samples"
        )
    stage_s = {name: statistics.median(run.seconds[name] for run in stages) for name in stages[0].seconds}
    summary = summarize_encode(plan, samples, [run.seconds for run in pipeline], kept, stage_s)
    vae_input_s = statistics.median(run.vae_input_s for run in stages)
    median_run = sorted(pipeline, key=lambda r: r.seconds)[len(pipeline) // 2]
    return (
        summary
        | main_thread_summary(pipeline)
        | steady_rate(median_run, summary["bound_samples_per_s"])
        | {
            "vae_input_share_of_vae": vae_input_s / stage_s["vae"] if stage_s["vae"] else 0.0,
            "latent_precision": precision_check(stage_cfg, encoders, plan),
            "encoder_compiled": stage_cfg.encoder.compile,
            "cudnn_autotuning": autotuned,  # what encode set for this encoder on this device
        }
    )


def main_thread_summary(runs: list[PipelineRun]) -> dict[str, Any]:
    """The main thread's seconds by phase in the median pipeline run, each phase's share of that run, and how
    busy the device was in it.

    At the bound on a GPU the main thread mostly waits: for the device (models are the slowest stage) or for
    the workers (decoding is). Its own work (`launch`, `writing`, `publishing`) is what the device waits for
    unless batches are queued ahead of it.
    """
    run = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    phases = {name: round(s, 4) for name, s in run.main_thread.items()}
    share = lambda s: s / run.seconds if run.seconds else 0.0  # noqa: E731
    busy, idle = run.device["busy"], run.device["idle"]
    return {
        "main_thread_s": phases,
        "main_thread_share": {name: share(s) for name, s in phases.items()},
        # `launch` by part (text tower, stacking the pixel batch, the VAE's copy and kernels queued)
        "main_thread_launch_share": {name: share(s) for name, s in run.launch.items()},
        # The device's side of the same run: idle between model calls (waiting for the host to queue the
        # next) as a share of the time from its first call to its last, and the models' rate while busy,
        # to set against `models_serial_samples_per_s` (the same models alone)
        "device_s": {"busy": round(busy, 4), "idle": round(idle, 4)},
        "device_idle_share": idle / (busy + idle) if busy + idle else 0.0,
        "device_busy_samples_per_s": run.samples / busy if busy else 0.0,
        "vae_input_shapes": run.vae_input_shapes,
    }


def steady_rate(run: PipelineRun, bound: float) -> dict[str, Any]:
    """The pipeline's rate once running: its samples over the span from the first model call to the last.

    A bench run is seconds long, and the seconds before the first model call (starting the decode workers,
    decoding the first batch) weigh in its whole-run rate as they do not in an encode of millions of
    samples: on the H200, 467 samples ran 3.85 s, 1.4 s of them before the first call. The span leaves out
    one batch's decoding (the first), so where decoding is the bound this overstates the rate by at most
    one batch in the run; where the models are, the span holds all their work and the rate is theirs."""
    span = run.device["busy"] + run.device["idle"]
    if not span or not run.samples:
        return {}
    rate = run.samples / span
    return {"steady_samples_per_s": rate, "steady_share_of_bound": rate / bound if bound else 0.0}


def precision_check(cfg: EncodeConfig, encoders: Encoders, plan: EncodeBenchConfig) -> dict[str, Any]:
    """`latent_precision` on up to LATENT_PRECISION_IMAGES kept images at the largest resolution."""
    from encode.precision import latent_precision

    res = max(plan.resolutions)
    samples, _ = prepare_all(cfg, encoders)
    pixels = [s.pixels[res] for s in samples if res in s.pixels][:LATENT_PRECISION_IMAGES]
    return latent_precision(encoders, pixels, plan.batch_size) if pixels else {"images": 0}


def summarize_encode(
    plan: EncodeBenchConfig, samples: int, seconds: list[float], kept: int, stage_s: dict[str, float]
) -> dict[str, Any]:
    rate = samples / statistics.median(seconds)
    stage_rates = {name: kept / s if s else float("inf") for name, s in stage_s.items()}
    models_rate = kept / (stage_s["vae"] + stage_s["text"])
    if plan.workers:
        bound = min(stage_rates["prepare"] * plan.workers, models_rate)
    else:  # no workers: preparing runs in the main process too, one after the other with the models
        bound = kept / sum(stage_s.values())
    slowest = min(stage_rates, key=lambda name: stage_rates[name])
    return {
        "images_per_s_per_device": rate,
        "samples": samples,
        "pipeline_s": seconds,
        "resolutions": plan.resolutions,
        "source_short_side": plan.source_short_side or "sample data (24-288 px)",
        "batch_size": plan.batch_size,
        "workers": plan.workers,
        "stages_samples_per_s": stage_rates,
        "models_serial_samples_per_s": models_rate,
        "slowest_stage": slowest,
        "bound_samples_per_s": bound,
        "share_of_bound": rate / bound,
        "share_of_slowest_stage": rate / stage_rates[slowest],
    }
