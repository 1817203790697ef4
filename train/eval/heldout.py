"""The held-out loss: fixed samples, fixed timesteps, fixed noise, so checkpoints compare by one number.

Sample i at timestep t gets its posterior eps and diffusion noise from a generator seeded by
(eval.seed, i, t) alone (`pair_seed`), with no caption dropout, offset noise or loss weighting: the plain
MSE of the model's prediction (epsilon or v, as trained) against its target. Nothing depends on which rank
evaluates a pair or in which batch, so the number is the same on any rank count, after a resume, and in
`python -m train eval` (train/eval/checkpoint.py) for the checkpoint written at that step.

Ranks split the samples in contiguous blocks (train/eval/data.py `rank_indices`); every rank runs the same
number of forwards (a short rank repeats a pair with weight 0), because an FSDP forward is collective.
Per-timestep sums and counts are all-reduced once, in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.contract import LATENT_LOGVAR, LATENT_MEAN, TEXT_EMBEDDING, TEXT_TOKENS
from train.config import EvalConfig
from train.data.draws import seed_of
from train.eval.data import EvalRows
from train.model.diffusion import Objective

Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def pair_seed(seed: int, index: int, timestep: int) -> int:
    """The seed of one (sample, timestep) pair's noise: independent of ranks, batches and resumes."""
    return seed_of("eval", seed, index, timestep)


def pair_noise(seed: int, index: int, timestep: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """(posterior eps, diffusion noise) of one pair, drawn on the CPU in this fixed order."""
    gen = torch.Generator().manual_seed(pair_seed(seed, index, timestep))
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


@dataclass
class Pair:
    row: int  # position in EvalRows
    timestep: int
    weight: float  # 0 for the padding a short rank adds


def rank_pairs(rows: EvalRows, timesteps: list[int], batch: int, num_batches: int) -> list[list[Pair]]:
    """This rank's (row, timestep) pairs in `num_batches` batches of `batch`, padded with weight-0 pairs."""
    weight = 0.0 if rows.padding else 1.0
    pairs = [Pair(r, t, weight) for r in range(len(rows.indices)) for t in timesteps]
    total = batch * num_batches
    pairs += [Pair(0, timesteps[0], 0.0) for _ in range(total - len(pairs))]
    return [pairs[i : i + batch] for i in range(0, total, batch)]


def build_inputs(
    objective: Objective, rows: EvalRows, pairs: list[Pair], seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noisy latents, timesteps, text, target) of one batch of pairs, on `device`."""
    cols = rows.columns
    shape = tuple(cols[LATENT_MEAN].shape[1:])
    noise = [pair_noise(seed, rows.indices[p.row], p.timestep, shape) for p in pairs]
    which = torch.tensor([p.row for p in pairs])
    eps = torch.stack([n[0] for n in noise]).to(device)
    fresh = torch.stack([n[1] for n in noise]).to(device)
    objective.to_device(device)
    mean, logvar = cols[LATENT_MEAN][which].to(device), cols[LATENT_LOGVAR][which].to(device)
    latents = objective.sample_latents(mean, logvar, eps)
    t = torch.tensor([p.timestep for p in pairs], device=device)
    ac = objective.alphas_cumprod[t][:, None, None, None]
    noisy = ac.sqrt() * latents + (1 - ac).sqrt() * fresh
    if objective.prediction_type == "epsilon":
        target = fresh
    else:
        target = ac.sqrt() * fresh - (1 - ac).sqrt() * latents
    keep = torch.ones(len(pairs), device=device)  # coin 1 >= any caption_dropout: never dropped
    batch = {name: cols[name][which].to(device) for name in (TEXT_EMBEDDING, TEXT_TOKENS) if name in cols}
    return noisy, t, objective.condition(batch, keep), target


@torch.no_grad()
def heldout_sums(
    denoise: Denoiser,
    objective: Objective,
    rows: EvalRows,
    cfg: EvalConfig,
    batches: list[list[Pair]],
    device: torch.device,
) -> torch.Tensor:
    """[2, T] float64: this rank's per-timestep sums of per-pair MSE (row 0) and pair counts (row 1)."""
    position = {t: j for j, t in enumerate(cfg.timesteps)}
    sums = torch.zeros(2, len(cfg.timesteps), dtype=torch.float64)
    for pairs in batches:
        noisy, t, text, target = build_inputs(objective, rows, pairs, cfg.seed, device)
        pred = denoise(noisy, t, text)
        mse = (pred.float() - target.float()).pow(2).mean(dim=(1, 2, 3)).double().cpu()
        for pair, value in zip(pairs, mse.tolist(), strict=True):
            sums[0, position[pair.timestep]] += pair.weight * value
            sums[1, position[pair.timestep]] += pair.weight
    return sums


def loss_metrics(sums: torch.Tensor, timesteps: list[int], weights: str) -> dict[str, float]:
    """Flat metrics from all-reduced sums: `eval/<weights>/loss` (the mean over timesteps of each
    timestep's mean) and `eval/<weights>/loss_t<T>`."""
    per_t = (sums[0] / sums[1]).tolist()
    out = {f"eval/{weights}/loss": sum(per_t) / len(per_t)}
    out.update({f"eval/{weights}/loss_t{t}": value for t, value in zip(timesteps, per_t, strict=True)})
    return out
