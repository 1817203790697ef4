"""The diffusion objective and the ComposerModel around a diffusers U-Net.

A training row holds the VAE posterior (mean, logvar, unscaled) and the text embedding. Per sample, with a
generator seeded by the row's `sample_seed` (train/data.py), we draw in a fixed order: the caption-dropout
coin, the timestep, the latent posterior eps, the diffusion noise and the offset-noise vector. Nothing
touches a global RNG, so resumed runs are exact and results do not depend on how a batch was split.

Latent = (mean + exp(0.5 * logvar) * eps) * scale_factor — the manifest's factor, applied exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from composer.models import ComposerModel

from shared.contract import LATENT_LOGVAR, LATENT_MEAN, TEXT_EMBEDDING
from train.config import ModelConfig
from train.data import SAMPLE_SEED

if TYPE_CHECKING:
    from diffusers import UNet2DConditionModel


def scheduler_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Noise-schedule settings shared by the DDPM training schedule and the DDIM/Euler samplers."""
    return {
        "num_train_timesteps": cfg.num_train_timesteps,
        "beta_start": cfg.beta_start,
        "beta_end": cfg.beta_end,
        "beta_schedule": cfg.beta_schedule,
        "prediction_type": cfg.prediction_type,
        "rescale_betas_zero_snr": cfg.zero_terminal_snr,
        # Zero terminal SNR only helps if sampling starts at the last timestep (Lin et al. 2023, sec. 3.3).
        "timestep_spacing": "trailing" if cfg.zero_terminal_snr else "leading",
        "steps_offset": 1,
    }


def training_alphas_cumprod(cfg: ModelConfig) -> torch.Tensor:
    """alpha-bar_t for t in [0, T) from diffusers' DDPMScheduler (float32)."""
    from diffusers import DDPMScheduler

    sched = DDPMScheduler(**scheduler_kwargs(cfg), clip_sample=False)
    return sched.alphas_cumprod.to(torch.float32).clone()


# --------------------------------------------------------------------------------------------- draws
@dataclass
class SampleDraws:
    """Every random number one batch needs, drawn per sample from its own seed (all on CPU)."""

    coin: torch.Tensor  # [B] uniform in [0, 1): caption dropout when < p
    timesteps: torch.Tensor  # [B] int64 in [0, T)
    latent_eps: torch.Tensor  # [B, C, H, W]: posterior sample noise
    noise: torch.Tensor  # [B, C, H, W]: diffusion noise
    offset: torch.Tensor  # [B, C]: offset-noise direction (drawn even when unused, so the order is fixed)


def draw_for_samples(seeds: torch.Tensor, latent_shape: tuple[int, ...], num_timesteps: int) -> SampleDraws:
    coins, steps, eps, noise, offset = [], [], [], [], []
    for seed in seeds.tolist():
        gen = torch.Generator().manual_seed(int(seed))
        coins.append(torch.rand((), generator=gen))
        steps.append(torch.randint(0, num_timesteps, (), generator=gen))
        eps.append(torch.randn(latent_shape, generator=gen))
        noise.append(torch.randn(latent_shape, generator=gen))
        offset.append(torch.randn(latent_shape[0], generator=gen))
    return SampleDraws(
        torch.stack(coins), torch.stack(steps), torch.stack(eps), torch.stack(noise), torch.stack(offset)
    )


# ------------------------------------------------------------------------------------------ objective
@dataclass
class TrainingInputs:
    noisy: torch.Tensor
    timesteps: torch.Tensor
    text: torch.Tensor
    target: torch.Tensor
    weight: torch.Tensor  # [B] per-sample loss weight


class Objective:
    """Turns a batch of stored posteriors + embeddings into U-Net inputs, targets and loss weights."""

    def __init__(self, cfg: ModelConfig, scale_factor: float, empty_caption: torch.Tensor):
        self.prediction_type = cfg.prediction_type
        self.caption_dropout = cfg.caption_dropout
        self.offset_noise = cfg.offset_noise
        self.min_snr_gamma = cfg.min_snr_gamma
        self.scale_factor = float(scale_factor)
        # Plain tensors, not buffers: Composer's EMA averages buffers too, which would blur these constants.
        self.alphas_cumprod = training_alphas_cumprod(cfg)
        self.empty_caption = empty_caption.to(torch.float32)

    @property
    def num_timesteps(self) -> int:
        return int(self.alphas_cumprod.shape[0])

    def prepare(self, batch: dict[str, torch.Tensor]) -> TrainingInputs:
        mean = batch[LATENT_MEAN]
        device = mean.device
        draws = draw_for_samples(batch[SAMPLE_SEED], tuple(mean.shape[1:]), self.num_timesteps)
        latents = self.sample_latents(mean, batch[LATENT_LOGVAR], draws.latent_eps.to(device))
        noise = draws.noise.to(device)
        if self.offset_noise:
            noise = noise + self.offset_noise * draws.offset.to(device)[:, :, None, None]
        t = draws.timesteps.to(device)
        ac = self.alphas_cumprod.to(device)[t][:, None, None, None]
        noisy = ac.sqrt() * latents + (1 - ac).sqrt() * noise
        target = noise if self.prediction_type == "epsilon" else ac.sqrt() * noise - (1 - ac).sqrt() * latents
        text = self.drop_captions(batch[TEXT_EMBEDDING].to(torch.float32), draws.coin.to(device))
        return TrainingInputs(noisy, t, text, target, self.loss_weight(t))

    def sample_latents(self, mean: torch.Tensor, logvar: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """A fresh draw from the stored posterior, times the manifest's scale factor (applied here only)."""
        mean, logvar = mean.to(torch.float32), logvar.to(torch.float32)
        return (mean + torch.exp(0.5 * logvar) * eps) * self.scale_factor

    def drop_captions(self, text: torch.Tensor, coin: torch.Tensor) -> torch.Tensor:
        drop = (coin < self.caption_dropout)[:, None, None]
        return torch.where(drop, self.empty_caption.to(text.device)[None], text)

    def loss_weight(self, t: torch.Tensor) -> torch.Tensor:
        if self.min_snr_gamma is None:
            return torch.ones(t.shape[0], device=t.device)
        ac = self.alphas_cumprod.to(t.device)[t]
        snr = ac / (1 - ac).clamp_min(1e-20)
        clipped = snr.clamp(max=self.min_snr_gamma)
        # MSE on eps equals SNR-weighted MSE on x0, on v it is (SNR + 1)-weighted; divide that out.
        denom = snr if self.prediction_type == "epsilon" else snr + 1
        return clipped / denom.clamp_min(1e-20)


# -------------------------------------------------------------------------------------------- model
@dataclass
class DenoiseInput:
    """A sampling call routed through the model's forward, so a wrapping FSDP root sees it."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    text: torch.Tensor


class DiffusionModel(ComposerModel):
    """ComposerModel: forward = U-Net prediction on freshly noised latents; loss = weighted MSE."""

    def __init__(self, unet: UNet2DConditionModel, objective: Objective):
        super().__init__()
        self.unet = unet
        self.objective = objective

    def forward(self, batch: Any) -> Any:
        if isinstance(batch, DenoiseInput):
            return self.unet(batch.latents, batch.timesteps, encoder_hidden_states=batch.text).sample
        inputs = self.objective.prepare(batch)
        pred = self.unet(inputs.noisy, inputs.timesteps, encoder_hidden_states=inputs.text).sample
        return pred, inputs.target, inputs.weight

    def loss(self, outputs: Any, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        pred, target, weight = outputs
        per_sample = (pred.float() - target.float()).pow(2).mean(dim=(1, 2, 3))
        return (per_sample * weight).mean()

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return {}

    def fsdp_wrap_fn(self, module: torch.nn.Module) -> bool:
        """FSDP units: each transformer and ResNet block (fine-grained enough to overlap comms)."""
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.transformers.transformer_2d import Transformer2DModel

        return isinstance(module, (Transformer2DModel, ResnetBlock2D))
