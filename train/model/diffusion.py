"""The diffusion objective and the ComposerModel around a diffusers U-Net.

A training row holds the VAE posterior (mean, logvar, unscaled), the text embedding and the per-sample
draws (caption-dropout coin, timestep, latent eps, noise, offset direction) that the loader workers derive
from the row's seed (train/data/draws.py). The step itself draws nothing and never reads a device tensor back
to the host: the schedule table and the empty-caption embedding move to the batch's device once and stay.

Latent = (mean + exp(0.5 * logvar) * eps) * scale_factor — the manifest's factor, applied exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from composer.models import ComposerModel

from shared.contract import LATENT_LOGVAR, LATENT_MEAN, TEXT_EMBEDDING, TEXT_TOKENS
from train.config import ModelConfig
from train.data.draws import SampleDraws, draw_for_samples
from train.model.online_text import OnlineText

__all__ = ["DenoiseInput", "DiffusionModel", "Objective", "SampleDraws", "TrainingInputs", "draw_for_samples"]

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

    def __init__(
        self,
        cfg: ModelConfig,
        scale_factor: float,
        empty_caption: torch.Tensor,
        online_text: OnlineText | None = None,
    ):
        self.prediction_type = cfg.prediction_type
        self.caption_dropout = cfg.caption_dropout
        self.offset_noise = cfg.offset_noise
        self.min_snr_gamma = cfg.min_snr_gamma
        self.scale_factor = float(scale_factor)
        # Plain tensors, not buffers: Composer's EMA averages buffers too, which would blur these constants.
        # They follow the batch to its device once (`to_device`), not on every step.
        self.alphas_cumprod = training_alphas_cumprod(cfg)
        self.empty_caption = empty_caption.to(torch.float32)
        # text.store=tokens: the frozen tower, a plain attribute, not a submodule
        # (train/model/online_text.py).
        self.online_text = online_text

    @property
    def num_timesteps(self) -> int:
        return int(self.alphas_cumprod.shape[0])

    def to_device(self, device: torch.device) -> None:
        """Keep the schedule and the empty-caption embedding where the batches are (a no-op after once)."""
        if self.alphas_cumprod.device != device:
            self.alphas_cumprod = self.alphas_cumprod.to(device)
            self.empty_caption = self.empty_caption.to(device)

    def prepare(self, batch: dict[str, torch.Tensor]) -> TrainingInputs:
        """U-Net inputs from a batch of stored columns and per-sample seeds; the draws are computed from the
        seeds on the batch's device (train/data/draws.py): device work only, no sync."""
        mean = batch[LATENT_MEAN]
        self.to_device(mean.device)
        draws = SampleDraws.from_batch(batch, tuple(mean.shape[1:]), self.num_timesteps)
        latents = self.sample_latents(mean, batch[LATENT_LOGVAR], draws.latent_eps)
        noise = draws.noise
        if self.offset_noise:
            noise = noise + self.offset_noise * draws.offset[:, :, None, None]
        t = draws.timesteps
        ac = self.alphas_cumprod[t][:, None, None, None]
        noisy = ac.sqrt() * latents + (1 - ac).sqrt() * noise
        target = noise if self.prediction_type == "epsilon" else ac.sqrt() * noise - (1 - ac).sqrt() * latents
        text = self.condition(batch, draws.coin)
        return TrainingInputs(noisy, t, text, target, self.loss_weight(t))

    def condition(self, batch: dict[str, torch.Tensor], coin: torch.Tensor) -> torch.Tensor:
        """The text embeddings the U-Net sees after caption dropout: stored, or computed from token ids
        (text.store=tokens) with the same coin, so both modes drop the same samples."""
        if TEXT_TOKENS not in batch:
            return self.drop_captions(batch[TEXT_EMBEDDING].to(torch.float32), coin)
        if self.online_text is None:
            raise ValueError("a batch of token ids (text.store=tokens) needs an Objective with online_text")
        return self.online_text.embed(batch[TEXT_TOKENS], coin < self.caption_dropout)

    def sample_latents(self, mean: torch.Tensor, logvar: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """A fresh draw from the stored posterior, times the manifest's scale factor (applied here only)."""
        mean, logvar = mean.to(torch.float32), logvar.to(torch.float32)
        return (mean + torch.exp(0.5 * logvar) * eps) * self.scale_factor

    def drop_captions(self, text: torch.Tensor, coin: torch.Tensor) -> torch.Tensor:
        drop = (coin.to(text.device) < self.caption_dropout)[:, None, None]
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

    def __init__(self, unet: UNet2DConditionModel, objective: Objective, channels_last: bool = False):
        super().__init__()
        self.unet = unet
        self.objective = objective
        # The layout of the U-Net's inputs (and of its weights, except under FSDP: train/model/assemble.py).
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        latents = latents.contiguous(memory_format=self.memory_format)
        return self.unet(latents, timesteps, encoder_hidden_states=text).sample

    def forward(self, batch: Any) -> Any:
        if isinstance(batch, DenoiseInput):
            return self.denoise(batch.latents, batch.timesteps, batch.text)
        inputs = self.objective.prepare(batch)
        pred = self.denoise(inputs.noisy, inputs.timesteps, inputs.text)
        return pred, inputs.target, inputs.weight

    def loss(self, outputs: Any, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        pred, target, weight = outputs
        per_sample = (pred.float() - target.float()).pow(2).mean(dim=(1, 2, 3))
        return (per_sample * weight).mean()

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return {}
