"""The train job's config: one nested dataclass, loaded from `jobs/train/<name>.yaml` + `key=value` overrides.

Batch sizes are given as `global_batch_size` and `device_microbatch_size`; the per-rank batch and gradient
accumulation are derived at launch (`shared.batching.derive_batching`), never written into configs.
Composer time strings (`20ba`, `1ep`, `10000sp`, `0.5dur`) are used for every duration and interval.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from shared import storage
from shared.config import ConfigError
from shared.manifest import fingerprint
from shared.presets import get_preset

# Composer time strings this job accepts: an integer count of a unit, or a fraction of the whole run.
_TIME_STRING = re.compile(r"^(\d+(ep|ba|sp|tok)|\d*\.?\d+dur)$")
_INTERVAL_UNITS = ("ba", "ep")

Precision = Literal["auto", "fp32", "amp_bf16", "amp_fp16"]
Device = Literal["auto", "cpu", "gpu"]
PredictionType = Literal["epsilon", "v_prediction"]
SamplerKind = Literal["ddim", "euler"]

SD2_PROMPTS = [
    "a photograph of an astronaut riding a horse",
    "a red sports car parked on a city street at night",
    "a bowl of fresh fruit on a wooden table, studio lighting",
    "a watercolor painting of a lighthouse on a cliff",
]


def check_time_string(value: str, key: str, units: tuple[str, ...] | None = None) -> str:
    """Reject anything Composer would not parse, naming the key and an example."""
    text = str(value).strip()
    if not _TIME_STRING.match(text):
        raise ConfigError(
            f"{key}={value!r} is not a Composer time string; use e.g. 20ba, 1ep, 10000sp or 0.5dur"
        )
    if units and not any(text.endswith(u) for u in units):
        raise ConfigError(f"{key}={value!r} must be in one of the units {list(units)} (e.g. 100ba)")
    return text


def time_count(value: str) -> int:
    """The integer count of a time string such as `100ba` (not for `dur`)."""
    return int(re.match(r"^\d+", value).group(0))  # type: ignore[union-attr]


BatchingMethod = Literal["random", "stratified", "per_stream", "device_per_stream"]


@dataclass
class StreamConfig:
    """One encoded dataset in a mix (data.streams); docs/dataset-mixing.md."""

    # The encode output root of this dataset: a local folder or s3://bucket/prefix.
    uri: str = ""
    # Its name in logs, metrics (data/samples/<name>) and checkpoints; "": the uri's last path part.
    name: str = ""
    # Dataset version id to pin; None: the current one at the first start.
    version: str | None = None
    # At most one of the three weights (Streaming's semantics). proportion: relative share of each epoch
    # (the shares are normalised over the mix); repeat: this many passes over the stream per epoch (2.0:
    # each sample twice, 0.5: half of them); choose: exactly this many of its samples per epoch. A mix uses
    # relative weights (proportion) or absolute ones (repeat / choose), never both; no weight: its size.
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None

    def __post_init__(self) -> None:
        name, weights = self.resolved_name() or "#?", [w for w in self._weights() if w[1] is not None]
        if not self.uri:
            raise ConfigError(f"data.streams: stream {name} has no uri; give each stream uri=<encode output>")
        if len(weights) > 1:
            raise ConfigError(
                f"data.streams: stream {name} sets {' and '.join(k for k, _ in weights)}; give one"
            )
        if weights and weights[0][1] <= 0:  # type: ignore[operator]
            raise ConfigError(f"data.streams: stream {name} has {weights[0][0]} <= 0; use a positive value")

    def _weights(self) -> list[tuple[str, float | int | None]]:
        return [("proportion", self.proportion), ("repeat", self.repeat), ("choose", self.choose)]

    def resolved_name(self) -> str:
        return self.name or self.uri.rstrip("/").rsplit("/", 1)[-1]

    def weight(self) -> tuple[str, float | int] | None:
        """("proportion" | "repeat" | "choose", value), or None when no weight is set."""
        return next(((k, v) for k, v in self._weights() if v is not None), None)


def check_streams(streams: list[StreamConfig], epoch_size: int | None) -> None:
    """The mix rules Streaming would enforce mid-construction, checked before any work, naming streams."""
    names = [s.resolved_name() for s in streams]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"data.streams: the name(s) {dupes} are used twice; give each stream its own name=")
    relative = [n for s, n in zip(streams, names, strict=True) if s.proportion is not None]
    absolute = [
        n for s, n in zip(streams, names, strict=True) if s.repeat is not None or s.choose is not None
    ]
    if relative and absolute:
        raise ConfigError(
            f"data.streams mixes relative weights (proportion: {', '.join(relative)}) with absolute ones "
            f"(repeat/choose: {', '.join(absolute)}), which Streaming refuses; weight every stream by "
            "proportion, or every stream by repeat/choose"
        )
    if relative and len(relative) != len(streams):
        unset = [n for n in names if n not in relative]
        raise ConfigError(f"data.streams: give {', '.join(unset)} a proportion too (all or none of a mix)")
    if epoch_size is not None and absolute:
        raise ConfigError(
            "data.epoch_size sets the epoch of a proportion mix; with repeat/choose the epoch is their sum "
            f"(streams {', '.join(absolute)}): drop data.epoch_size"
        )


@dataclass
class DataConfig:
    # The encode output root (the dataset config's output.uri): a local folder or s3://bucket/prefix.
    # The one-dataset shorthand; for a mix use `streams` instead (not both).
    uri: str = ""
    # Several encoded datasets mixed by Streaming (StreamConfig; docs/dataset-mixing.md). []: just `uri`.
    streams: list[StreamConfig] = field(default_factory=list)
    # How a mix fills each batch (Streaming's batching_method): random (samples drawn across streams),
    # stratified (every batch holds each stream's share), per_stream (each batch from one stream),
    # device_per_stream (each device batch from one stream).
    batching_method: BatchingMethod = "random"
    # Samples per epoch of a proportion mix (Streaming's epoch_size); None: the streams' total size.
    epoch_size: int | None = None
    # Which of the dataset's resolutions this phase trains on (256 for SD2 phase 1, 512 for phase 2).
    resolution: int = 256
    # Dataset version id to pin (versions/<vid>/ in the encode output); None: the current one at start.
    version: str | None = None
    # Local cache root for downloaded shards; each (dataset root, version, resolution) gets its own folder
    # below it, because two live StreamingDatasets must not share one. "": <tmp>/sd-pretrain-streaming-<uid>,
    # private to this user (a planted folder there is refused, not used).
    cache_dir: str = ""
    # Resuming against a dataset with another fingerprint is refused unless this is true.
    allow_dataset_change: bool = False
    shuffle: bool = True
    shuffle_algo: Literal["py1e", "py1br", "py1b", "py1s", "py2s", "naive"] = "py1e"
    shuffle_seed: int | None = None  # None: the run's `seed`
    shuffle_block_size: int | None = None  # None: Streaming's default for shuffle_algo
    # Fixes the sample order independently of the GPU count, so a run resumed on a different number of
    # nodes sees the same order. None: the number of physical nodes at the first start.
    num_canonical_nodes: int | None = None
    predownload: int | None = None  # samples to download ahead per worker; None: Streaming's default
    cache_limit: str | None = None  # e.g. "200gb": evict the coldest shards above this; None: keep all
    download_timeout: float = 120.0  # seconds per shard
    num_workers: int = 8  # dataloader worker processes per rank
    prefetch_factor: int = 2  # batches each worker loads ahead (only with num_workers > 0)

    def __post_init__(self) -> None:
        if self.uri and self.streams:
            raise ConfigError(
                "data.uri and data.streams are both set: data.uri is the one-dataset shorthand; move it into "
                "data.streams (or pass data.uri= to clear it)"
            )
        if self.streams:
            check_streams(self.streams, self.epoch_size)
        if self.epoch_size is not None and self.epoch_size < 1:
            raise ConfigError(f"data.epoch_size must be >= 1 or null, got {self.epoch_size}")

    def is_mix(self) -> bool:
        return bool(self.streams)


@dataclass
class ModelConfig:
    # Preset naming the U-Net shapes (shared/presets.py); must match the dataset's latent/text shapes.
    preset: str = "sd2-base"
    # A diffusers folder with unet/ to start from; None: random init (pretraining).
    init_from: str | None = None
    prediction_type: PredictionType = "epsilon"
    # DDPM noise schedule (SD2: 1000 steps, scaled_linear betas 0.00085 -> 0.012).
    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: Literal["scaled_linear", "linear"] = "scaled_linear"
    # Rescale betas so the last timestep is pure noise (Lin et al. 2023); needs v_prediction.
    zero_terminal_snr: bool = False
    # Offset noise strength (per-channel constant noise added to the Gaussian noise); 0: off.
    offset_noise: float = 0.0
    # Min-SNR-gamma loss weighting (Hang et al. 2023), e.g. 5.0; None: plain MSE.
    min_snr_gamma: float | None = None
    # Probability of training a sample on the empty-caption embedding (for classifier-free guidance).
    caption_dropout: float = 0.1
    # VAE latent scale factor; None: the dataset manifest's (set only to assert a value).
    scale_factor: float | None = None
    gradient_checkpointing: bool = False
    # text.store=tokens datasets: a diffusers folder / hub id with text_encoder/ + tokenizer/ to run in the
    # step (None: the folder the dataset manifest records). Its weights hash must match the manifest's.
    text_encoder: str | None = None


@dataclass
class OptimizerConfig:
    # torch.optim.AdamW (weight decay applied as lr * weight_decay * w, as in the SD2 recipe).
    lr: float = 1.0e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1.0e-8
    warmup: str = "10000ba"  # linear warmup from 0 to lr
    schedule: Literal["constant", "cosine"] = "constant"  # after warmup
    grad_clip_norm: float | None = 1.0  # None: no clipping
    # torch's fused AdamW kernel (CPU and CUDA): one pass over every parameter instead of a Python loop of
    # ~10 ops per tensor (tiny CPU U-Net, 208 tensors: 7.0 -> 1.2 ms per step), and gradient clipping's
    # scale is applied inside it, saving a read and write of every gradient. false: torch's default.
    fused: bool = True


@dataclass
class EMAConfig:
    enabled: bool = True
    smoothing: float = 0.9999  # per optimizer step
    start: str = "0ba"  # when the average starts (Composer time string, batches or epochs)
    # How often the average is updated. Composer's EMA summons full parameters under FSDP on each update,
    # so FSDP runs may update every N batches; the per-update smoothing is then smoothing**N, which keeps
    # the same half-life in optimizer steps.
    update_interval: str = "1ba"

    def half_life_steps(self) -> float:
        import math

        return math.log(0.5) / math.log(self.smoothing)


@dataclass
class SamplesConfig:
    enabled: bool = True
    interval: str = "5000ba"  # render a grid every N batches (and at the end of training)
    prompts: list[str] = field(default_factory=lambda: list(SD2_PROMPTS))
    images_per_prompt: int = 2
    steps: int = 25
    guidance_scale: float = 7.5
    sampler: SamplerKind = "ddim"
    seed: int = 0  # fixed: the same starting noise every time, so grids are comparable over training


@dataclass
class LogConfig:
    console_interval: str = "10ba"
    # Batches averaged for images/s; Composer's SpeedMonitor logs nothing until this window has filled.
    speed_window: int = 50
    # Local folder for train.log, metrics.jsonl, samples/ and train_config.yaml. "": the save_folder when it
    # is local; for an s3:// save_folder, <tmp>/sd-pretrain-runs-<uid>/<run_name> (private to this user)
    # mirrored to the save_folder.
    local_dir: str = ""
    tensorboard: bool = False
    wandb_project: str | None = None  # set to log to Weights & Biases (needs `wandb` installed)
    wandb_entity: str | None = None


@dataclass
class TrainConfig:
    name: str = "train"
    # A stable id for autoresume; "": <name>-<hash of save_folder>, so rerunning the same command finds it.
    run_name: str = ""
    seed: int = 17
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    log: LogConfig = field(default_factory=LogConfig)
    global_batch_size: int = 2048
    device_microbatch_size: int = 4
    max_duration: str = "1ep"
    device: Device = "auto"
    precision: Precision = "auto"  # auto: amp_bf16 on GPU, fp32 on CPU
    fsdp: bool = False  # shard with FSDP (GPU only)
    fsdp_sharding_strategy: Literal["SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD"] = "SHARD_GRAD_OP"
    # dtype FSDP reduce-scatters gradients in: fp32 (exact sums, 4 bytes per parameter per microbatch) or
    # bf16 (half the bytes; sums over many ranks lose precision). Params are gathered in `precision`'s dtype.
    fsdp_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # torch.compile the U-Net (only the U-Net, in place: parameter names stay the same;
    # train/model/assemble.py).
    compile: bool = False
    # U-Net weights and inputs in NHWC layout, which cuDNN convolutions run natively. GPU runs only: a CPU
    # run keeps NCHW whatever this says. `make bench` builds its model through the same switch.
    channels_last: bool = True
    # Checkpoints: a local folder or s3://bucket/prefix.
    save_folder: str = ""
    # How a checkpoint is written. full: every weight, the EMA and AdamW state are gathered onto rank 0,
    # which writes one .pt (~14 GB for SD2-base, at one node's write bandwidth). sharded: every rank writes
    # its own part in parallel into a folder per checkpoint (train/checkpoints/sharded.py); Composer writes
    # those only under FSDP. auto: sharded when fsdp=true on more than one rank, else full. Either format
    # resumes on any rank count, and a run resuming the other format converts it once at start.
    checkpoint_format: Literal["auto", "full", "sharded"] = "auto"
    save_interval: str = "2500ba"
    save_num_checkpoints_to_keep: int = -1  # local copies kept (-1: all)
    # Checkpoints kept in an s3:// save_folder (-1: all). Composer never deletes remote checkpoints; an
    # SD2-base checkpoint with EMA and AdamW state is ~14 GB, so a long run keeps a few.
    save_num_remote_checkpoints_to_keep: int = -1
    # Continue from the latest checkpoint in save_folder when there is one (else start / load load_path).
    autoresume: bool = True
    # A checkpoint file or a save folder (-> its latest) to start from when there is nothing to autoresume.
    load_path: str | None = None
    # Phase handoff: take only the weights (EMA weights, see train/ema/algorithm.py) with a fresh
    # optimizer/schedule.
    load_weights_only: bool = False

    def __post_init__(self) -> None:
        self._check_model()
        self._check_times()
        self._check_batching()
        if not self.save_folder:
            raise ConfigError("save_folder is empty: set it in the train YAML or pass save_folder=...")
        if self.load_weights_only and not self.load_path:
            raise ConfigError("load_weights_only=true needs load_path=<checkpoint file or save folder>")
        if self.save_num_remote_checkpoints_to_keep == 0 or self.save_num_remote_checkpoints_to_keep < -1:
            raise ConfigError(
                "save_num_remote_checkpoints_to_keep must be >= 1 (the newest checkpoints kept) or -1 (all), "
                f"got {self.save_num_remote_checkpoints_to_keep}"
            )
        if self.checkpoint_format == "sharded" and not self.fsdp:
            raise ConfigError(
                "checkpoint_format=sharded needs fsdp=true (Composer writes sharded checkpoints only under "
                "its FSDP); pass fsdp=true, or checkpoint_format=auto / full"
            )
        if self.fsdp and self.device == "cpu":
            raise ConfigError("fsdp=true needs GPUs; use device=auto/gpu or fsdp=false on CPU")
        if self.device == "cpu" and self.precision.startswith("amp"):
            raise ConfigError(f"precision={self.precision} needs a GPU; CPU training runs precision=fp32")

    def _check_model(self) -> None:
        try:
            get_preset(self.model.preset).latent_shape(self.data.resolution)
        except ValueError as err:  # unknown preset, or a resolution the VAE cannot downsample evenly
            raise ConfigError(f"model.preset / data.resolution: {err}") from err
        model = self.model
        if model.zero_terminal_snr and model.prediction_type != "v_prediction":
            raise ConfigError(
                "model.zero_terminal_snr=true gives the last timestep zero signal, which epsilon prediction "
                "cannot learn; set model.prediction_type=v_prediction"
            )
        if not 0.0 <= model.caption_dropout < 1.0:
            raise ConfigError(f"model.caption_dropout must be in [0, 1), got {model.caption_dropout}")
        if model.min_snr_gamma is not None and model.min_snr_gamma <= 0:
            raise ConfigError(
                f"model.min_snr_gamma must be > 0 (e.g. 5.0) or null, got {model.min_snr_gamma}"
            )
        if not 0.0 < self.ema.smoothing < 1.0:
            raise ConfigError(f"ema.smoothing must be in (0, 1), e.g. 0.9999; got {self.ema.smoothing}")

    def _check_times(self) -> None:
        self.max_duration = check_time_string(self.max_duration, "max_duration")
        self.save_interval = check_time_string(self.save_interval, "save_interval", _INTERVAL_UNITS)
        self.optimizer.warmup = check_time_string(self.optimizer.warmup, "optimizer.warmup")
        self.ema.start = check_time_string(self.ema.start, "ema.start", ("ba", "ep", "dur"))
        self.ema.update_interval = check_time_string(self.ema.update_interval, "ema.update_interval", ("ba",))
        self.samples.interval = check_time_string(self.samples.interval, "samples.interval", _INTERVAL_UNITS)
        self.log.console_interval = check_time_string(
            self.log.console_interval, "log.console_interval", ("ba",)
        )
        if time_count(self.ema.update_interval) < 1:
            raise ConfigError("ema.update_interval must be at least 1ba")

    def _check_batching(self) -> None:
        if self.global_batch_size < 1 or self.device_microbatch_size < 1:
            raise ConfigError("global_batch_size and device_microbatch_size must be >= 1")
        if self.data.num_workers < 0:
            raise ConfigError("data.num_workers must be >= 0")
        if self.log.speed_window < 1:
            raise ConfigError("log.speed_window must be >= 1 (batches averaged for images/s)")

    # ------------------------------------------------------------------------------------ derived values
    def resolved_run_name(self) -> str:
        """Stable across reruns of the same command: autoresume looks for this run's checkpoints."""
        return self.run_name or f"{self.name}-{fingerprint(self.save_folder.rstrip('/'))[:8]}"

    def resolved_checkpoint_format(self, world_size: int) -> Literal["full", "sharded"]:
        """checkpoint_format with auto decided: sharded under FSDP on more than one rank (where a full
        checkpoint would funnel ~14 GB through rank 0 at every save), else full."""
        if self.checkpoint_format != "auto":
            return self.checkpoint_format
        return "sharded" if self.fsdp and world_size > 1 else "full"

    def save_is_remote(self) -> bool:
        return storage.is_s3(self.save_folder)

    def ema_update_every(self) -> int:
        return time_count(self.ema.update_interval)

    def ema_smoothing_per_update(self) -> float:
        """Per-update smoothing that keeps ema.smoothing's half-life in optimizer steps."""
        return self.ema.smoothing ** self.ema_update_every()
