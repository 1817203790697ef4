"""The train config's smaller sections: model, optimizer, EMA, samples, eval, log, resilience."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shared.config import ConfigError
from shared.config.values import allowed
from shared.runtime.background import CLOSE_WAIT_S
from train.config.checks import (
    _INTERVAL_UNITS,
    SD2_PROMPTS,
    PredictionType,
    SamplerKind,
    time_string,
    wall_time,
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
    num_train_timesteps: int = allowed(1000, ge=1)
    beta_start: float = allowed(0.00085, gt=0, lt=1)
    beta_end: float = allowed(0.012, gt=0, lt=1)
    beta_schedule: Literal["scaled_linear", "linear"] = "scaled_linear"
    # Rescale betas so the last timestep is pure noise (Lin et al. 2023); needs v_prediction.
    zero_terminal_snr: bool = False
    # Offset noise strength (per-channel constant noise added to the Gaussian noise); 0: off.
    offset_noise: float = allowed(0.0, ge=0)
    # Min-SNR-gamma loss weighting (Hang et al. 2023), e.g. 5.0; None: plain MSE.
    min_snr_gamma: float | None = allowed(None, gt=0)
    # Probability of training a sample on the empty-caption embedding (for classifier-free guidance).
    caption_dropout: float = allowed(0.1, ge=0, lt=1)
    # VAE latent scale factor; None: the dataset manifest's (set only to assert a value).
    scale_factor: float | None = allowed(None, gt=0)
    gradient_checkpointing: bool = False
    # GroupNorm and LayerNorm in the autocast dtype (bf16) instead of autocast's fp32 (shared/norms.py):
    # half their bytes, and one dtype for inductor to fuse each norm with its SiLU. Only acts under autocast
    # (GPU amp_bf16): an fp32 run, every CPU run, computes exactly what it did without it.
    low_precision_norms: bool = False
    # Keep the compiled U-Net's activations channels_last end to end (train/model/layout.py): GroupNorm as
    # reductions over a grouped view (ATen's CUDA kernel and its decomposition both hand back NCHW), and each
    # convolution's input and gradient made channels_last. On the H200 7% of the step was cuDNN's
    # convolution backward converting NCHW tensors it was fed. Acts only when compiled with channels_last;
    # not yet timed on a GPU, so off (make bench BENCH=full's keep_channels_last variant measures it).
    keep_channels_last: bool = False
    # text.store=tokens datasets: a diffusers folder / hub id with text_encoder/ + tokenizer/ to run in the
    # step (None: the folder the dataset manifest records). Its weights hash must match the manifest's.
    text_encoder: str | None = None


@dataclass
class OptimizerConfig:
    # torch.optim.AdamW (weight decay applied as lr * weight_decay * w, as in the SD2 recipe).
    lr: float = allowed(1.0e-4, gt=0)
    weight_decay: float = allowed(0.01, ge=0)
    betas: tuple[float, float] = allowed((0.9, 0.999), ge=0, lt=1)
    eps: float = allowed(1.0e-8, gt=0)
    warmup: str = allowed("10000ba", check=time_string())  # linear warmup from 0 to lr
    schedule: Literal["constant", "cosine"] = "constant"  # after warmup
    grad_clip_norm: float | None = allowed(1.0, gt=0)  # None: no clipping
    # torch's fused AdamW kernel (CPU and CUDA): one pass over every parameter instead of a Python loop of
    # ~10 ops per tensor (tiny CPU U-Net, 208 tensors: 7.0 -> 1.2 ms per step), and gradient clipping's
    # scale is applied inside it, saving a read and write of every gradient. false: torch's default.
    fused: bool = True


@dataclass
class EMAConfig:
    enabled: bool = True
    smoothing: float = allowed(0.9999, gt=0, lt=1)  # per optimizer step, e.g. 0.9999
    # When the average starts (Composer time string, batches or epochs).
    start: str = allowed("0ba", check=time_string("ba", "ep", "dur"))
    # How often the average is updated. Composer's EMA summons full parameters under FSDP on each update,
    # so FSDP runs may update every N batches; the per-update smoothing is then smoothing**N, which keeps
    # the same half-life in optimizer steps.
    update_interval: str = allowed("1ba", check=time_string("ba", at_least=1))

    def half_life_steps(self) -> float:
        import math

        return math.log(0.5) / math.log(self.smoothing)


@dataclass
class SamplesConfig:
    enabled: bool = True
    # Render a grid every N batches (and at the end of training).
    interval: str = allowed("5000ba", check=time_string(*_INTERVAL_UNITS))
    prompts: list[str] = field(default_factory=lambda: list(SD2_PROMPTS))
    images_per_prompt: int = allowed(2, ge=1)
    steps: int = allowed(25, ge=1)
    guidance_scale: float = 7.5
    sampler: SamplerKind = "ddim"
    seed: int = 0  # fixed: the same starting noise every time, so grids are comparable over training


@dataclass
class EvalConfig:
    # Held-out loss during training (train/eval/): an encoded dataset (a `make encode` output.uri, same
    # contract and resolution as data.uri) kept out of training; "": no eval.
    uri: str = ""
    version: str | None = None  # dataset version id to pin; None: the current one at start
    # Evaluate every N batches (and at the end of training).
    interval: str = allowed("5000ba", check=time_string(*_INTERVAL_UNITS))
    # The first num_samples samples of the eval dataset, in stored order, each at every timestep below.
    num_samples: int = allowed(2048, ge=1)
    timesteps: list[int] = field(default_factory=lambda: [100, 300, 500, 700, 900])
    # Noise per (seed, sample index, timestep): the same number for the same weights on any rank count.
    seed: int = 0
    # (sample, timestep) pairs per forward on each rank; 0: device_microbatch_size.
    batch_size: int = 0


def check_eval(cfg: EvalConfig, num_train_timesteps: int) -> None:
    """The eval section's rules (also checked for `train eval` overrides)."""
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
    console_interval: str = allowed("10ba", check=time_string("ba"))
    # Batches averaged for images/s; Composer's SpeedMonitor logs nothing until this window has filled.
    speed_window: int = allowed(50, ge=1)
    # Local folder for train.log, metrics.jsonl, samples/ and train_config.yaml. "": the save_folder when it
    # is local; for an s3:// save_folder, <tmp>/sd-pretrain-runs-<uid>/<run_name> (private to this user)
    # mirrored to the save_folder.
    local_dir: str = ""
    tensorboard: bool = False
    wandb_project: str | None = None  # set to log to Weights & Biases (needs `wandb` installed)
    wandb_entity: str | None = None


# Of the timeout that would end a rank waiting on a shard (another rank's collective, or the hang timeout):
# the rest is left for the download itself once S3 answers, and for the step.
SHARD_PATIENCE_SHARE = 0.75


@dataclass
class ResilienceConfig:
    """Unattended runs (docs/running-unattended.md): what the supervising launch process and the ranks do
    on a signal, a deadline, a dead or hung rank."""

    # Whole-job restarts from the last checkpoint after a rank dies or hangs, per launch (a Slurm segment).
    max_restarts: int = 3
    # A rank that completes no step for this long is hung: stacks logged, ranks killed, restart. Must exceed
    # the longest pause between steps (a checkpoint save, a sample grid).
    hang_timeout_s: float = allowed(600.0, gt=0)
    # Collective timeout from the second step on (the first keeps Composer's 300 s for start-up).
    collective_timeout_s: float = allowed(120.0, gt=0)
    # Slurm: times the job requeues itself after saving at its time limit or on preemption.
    max_requeues: int = 20
    # Save and exit resumable (code 75) this long after the launch started, e.g. 11.5h; null: no limit.
    max_wall_time: str | None = allowed(None, check=wall_time)
    # Seconds before a deadline by which the save must start; null: from the plan's estimated save time.
    exit_lead_s: float | None = None
    # How long an S3 outage (no connection, timeouts, 5xx, throttling) is waited out before the run gives up
    # on it: a checkpoint upload retries in the background meanwhile, and a run starting (or restarting)
    # waits for S3 before it reads anything. A shard download a step waits on gets less: 3/4 of
    # collective_timeout_s (the other ranks wait in a collective meanwhile) or of hang_timeout_s on one rank.
    # Past it: an upload's outage restarts the ranks; a start still waiting exits 75 (rerun, or requeued).
    outage_patience_s: float = allowed(1800.0, gt=0)

    def max_wall_time_s(self) -> float | None:
        return None if self.max_wall_time is None else wall_time_seconds(self.max_wall_time, "max_wall_time")

    def closing_s(self) -> float:
        """For how long at most a rank that ended training says it is still closing (its last uploads may
        each wait out an outage); then it has hang_timeout_s to exit (train/resilience/monitor.py)."""
        return self.outage_patience_s + self.hang_timeout_s

    def close_wait_s(self) -> float:
        """What a closing run gives each best-effort S3 task (the run folder's last copy, the last prune, the
        lease's release): never more than the outage patience (shared/runtime/background.py)."""
        return min(CLOSE_WAIT_S, self.outage_patience_s)

    def shard_patience_s(self, world_size: int) -> float:
        """How long a shard download a step waits on sits out an S3 outage (see outage_patience_s): a
        waiting rank must not outlast the other ranks' collective timeout, nor the hang timeout alone."""
        bound = self.collective_timeout_s if world_size > 1 else self.hang_timeout_s
        return min(self.outage_patience_s, SHARD_PATIENCE_SHARE * bound)
