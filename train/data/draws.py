"""Every random number a training sample needs, drawn from its own seed where the sample is read.

Per sample, with a generator seeded by the row's `sample_seed` (train/data/loader.py), we draw in a fixed
order: the caption-dropout coin, the timestep, the latent posterior eps, the diffusion noise and the
offset-noise vector. Nothing touches a global RNG, so resumed runs are exact and results do not depend on how
a batch was split.

The draws happen in the data loader's workers (`draw_columns`, called per row by the dataset) and travel
in the pinned batch as ordinary columns, so the training step never turns device tensors into Python
numbers (a host-device sync per step, issue 11) and never copies per-sample draws from host memory in the
middle of the step. Batches built elsewhere (the bench's synthetic batches, tests) get the same columns from
`attach_draws`. torch only: train/data/loader.py imports this without Composer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.contract import LATENT_MEAN

SAMPLE_SEED = "sample_seed"  # int64 batch column: the seed of every random draw for that sample
# Batch columns holding the per-sample draws (beside the stored columns and SAMPLE_SEED).
DRAW_COIN = "draw_coin"  # [B] float32 uniform in [0, 1): caption dropout when < p
DRAW_TIMESTEP = "draw_timestep"  # [B] int64 in [0, T)
DRAW_LATENT_EPS = "draw_latent_eps"  # [B, C, H, W] float32: posterior sample noise
DRAW_NOISE = "draw_noise"  # [B, C, H, W] float32: diffusion noise
DRAW_OFFSET = "draw_offset"  # [B, C] float32: offset-noise direction (drawn even when unused: fixed order)
DRAW_COLUMNS = (DRAW_COIN, DRAW_TIMESTEP, DRAW_LATENT_EPS, DRAW_NOISE, DRAW_OFFSET)


class MissingDrawsError(KeyError):
    """A batch reached the objective without its per-sample draw columns."""


@dataclass
class SampleDraws:
    """The draws of a batch, one row per sample (on whatever device the batch is)."""

    coin: torch.Tensor
    timesteps: torch.Tensor
    latent_eps: torch.Tensor
    noise: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def from_batch(cls, batch: dict[str, torch.Tensor]) -> SampleDraws:
        missing = [name for name in DRAW_COLUMNS if name not in batch]
        if missing:
            raise MissingDrawsError(
                f"the batch has no {missing} columns: batches come from train.data.loader, which draws "
                "them per sample; for a batch built by hand call train.data.draws.attach_draws(batch, "
                "num_timesteps) first"
            )
        return cls(*(batch[name] for name in DRAW_COLUMNS))


def draw_columns(seed: int, latent_shape: tuple[int, ...], num_timesteps: int) -> dict[str, torch.Tensor]:
    """One sample's draws from its seed, as batch columns (the fixed order is part of resume exactness)."""
    gen = torch.Generator().manual_seed(int(seed))
    return {
        DRAW_COIN: torch.rand((), generator=gen),
        DRAW_TIMESTEP: torch.randint(0, num_timesteps, (), generator=gen),
        DRAW_LATENT_EPS: torch.randn(latent_shape, generator=gen),
        DRAW_NOISE: torch.randn(latent_shape, generator=gen),
        DRAW_OFFSET: torch.randn(latent_shape[0], generator=gen),
    }


def draw_for_samples(seeds: torch.Tensor, latent_shape: tuple[int, ...], num_timesteps: int) -> SampleDraws:
    """The draws of a batch of seeds (a host tensor): what the loader's collated columns hold."""
    rows = [draw_columns(seed, latent_shape, num_timesteps) for seed in seeds.tolist()]
    return SampleDraws(*(torch.stack([row[name] for row in rows]) for name in DRAW_COLUMNS))


def attach_draws(batch: dict[str, torch.Tensor], num_timesteps: int) -> dict[str, torch.Tensor]:
    """`batch` plus its draw columns, computed from its seeds on the host and placed beside the latents."""
    latent = batch[LATENT_MEAN]
    draws = draw_for_samples(batch[SAMPLE_SEED].cpu(), tuple(latent.shape[1:]), num_timesteps)
    columns = {name: getattr(draws, field).to(latent.device) for name, field in _FIELDS.items()}
    return {**batch, **columns}


_FIELDS = {
    DRAW_COIN: "coin",
    DRAW_TIMESTEP: "timesteps",
    DRAW_LATENT_EPS: "latent_eps",
    DRAW_NOISE: "noise",
    DRAW_OFFSET: "offset",
}
