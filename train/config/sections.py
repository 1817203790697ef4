"""The train config's smaller sections: model, optimizer, EMA, samples, eval, log, resilience."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shared.config import ConfigError
from train.config.checks import (
    _INTERVAL_UNITS,
    SD2_PROMPTS,
    PredictionType,
    SamplerKind,
    check_time_string,
    wall_time_seconds,
)


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
    # GroupNorm and LayerNorm in the autocast dtype (bf16) instead of autocast's fp32 (shared/norms.py):
    # half their bytes, and one dtype for inductor to fuse each norm with its SiLU. Only acts under autocast
    # (GPU amp_bf16): an fp32 run, every CPU run, computes exactly what it did without it.
    low_precision_norms: bool = False
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
class EvalConfig:
    # Held-out loss during training (train/eval/): an encoded dataset (a `make encode` output.uri, same
    # contract and resolution as data.uri) kept out of training; "": no eval.
    uri: str = ""
    version: str | None = None  # dataset version id to pin; None: the current one at start
    interval: str = "5000ba"  # evaluate every N batches (and at the end of training)
    # The first num_samples samples of the eval dataset, in stored order, each at every timestep below.
    num_samples: int = 2048
    timesteps: list[int] = field(default_factory=lambda: [100, 300, 500, 700, 900])
    # Noise per (seed, sample index, timestep): the same number for the same weights on any rank count.
    seed: int = 0
    # (sample, timestep) pairs per forward on each rank; 0: device_microbatch_size.
    batch_size: int = 0


def check_eval(cfg: EvalConfig, num_train_timesteps: int) -> None:
    """The eval section's rules (also checked for `train eval` overrides)."""
    cfg.interval = check_time_string(cfg.interval, "eval.interval", _INTERVAL_UNITS)
    if cfg.num_samples < 1:
        raise ConfigError(f"eval.num_samples must be >= 1, got {cfg.num_samples}")
    if cfg.batch_size < 0:
        raise ConfigError(f"eval.batch_size must be >= 1 (0: device_microbatch_size), got {cfg.batch_size}")
    steps = list(cfg.timesteps)
    if not steps or len(set(steps)) != len(steps):
        raise ConfigError(f"eval.timesteps must be a non-empty list of distinct timesteps, got {steps}")
    bad = [t for t in steps if not 0 <= t < num_train_timesteps]
    if bad:
        raise ConfigError(
            f"eval.timesteps {bad} are outside [0, {num_train_timesteps}) (model.num_train_timesteps); "
            "use e.g. [100, 300, 500, 700, 900]"
        )


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
class ResilienceConfig:
    """Unattended runs (docs/running-unattended.md): what the supervising launch process and the ranks do
    on a signal, a deadline, a dead or hung rank."""

    # Whole-job restarts from the last checkpoint after a rank dies or hangs, per launch (a Slurm segment).
    max_restarts: int = 3
    # A rank that completes no step for this long is hung: stacks logged, ranks killed, restart. Must exceed
    # the longest pause between steps (a checkpoint save, a sample grid).
    hang_timeout_s: float = 600.0
    # Collective timeout from the second step on (the first keeps Composer's 300 s for start-up).
    collective_timeout_s: float = 120.0
    # Slurm: times the job requeues itself after saving at its time limit or on preemption.
    max_requeues: int = 20
    # Save and exit resumable (code 75) this long after the launch started, e.g. 11.5h; null: no limit.
    max_wall_time: str | None = None
    # Seconds before a deadline by which the save must start; null: from the plan's estimated save time.
    exit_lead_s: float | None = None

    def __post_init__(self) -> None:
        for key in ("max_restarts", "max_requeues"):
            if getattr(self, key) < 0:
                raise ConfigError(f"resilience.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("hang_timeout_s", "collective_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"resilience.{key} must be > 0 seconds, got {getattr(self, key)}")
        if self.max_wall_time is not None:
            wall_time_seconds(self.max_wall_time, "resilience.max_wall_time")
        if self.exit_lead_s is not None and self.exit_lead_s < 0:
            raise ConfigError(f"resilience.exit_lead_s must be >= 0 seconds, got {self.exit_lead_s}")

    def max_wall_time_s(self) -> float | None:
        return None if self.max_wall_time is None else wall_time_seconds(self.max_wall_time, "max_wall_time")
