"""The diffusion objective: per-sample randomness, caption dropout, latent scaling, targets and weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.contract import LATENT_LOGVAR, LATENT_MEAN, TEXT_EMBEDDING
from train.config import ModelConfig
from train.data.draws import SAMPLE_SEED, sample_seed
from train.model.diffusion import Objective, draw_for_samples, training_alphas_cumprod

LATENT = (4, 8, 8)
TEXT = (77, 32)


def make_batch(seeds: list[int], scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A batch as the loader delivers it: stored columns and per-sample seeds."""
    gen = torch.Generator().manual_seed(0)
    n = len(seeds)
    batch = {
        LATENT_MEAN: (torch.randn((n, *LATENT), generator=gen) * scale).half(),
        LATENT_LOGVAR: torch.full((n, *LATENT), -4.0).half(),
        TEXT_EMBEDDING: torch.randn((n, *TEXT), generator=gen).half(),
        SAMPLE_SEED: torch.tensor(seeds, dtype=torch.int64),
    }
    return batch


def objective(**changes: object) -> Objective:
    cfg = ModelConfig(preset="tiny", **changes)  # type: ignore[arg-type]
    return Objective(cfg, scale_factor=0.5, empty_caption=torch.zeros(TEXT))


def test_sample_seed_depends_on_seed_epoch_and_index_only() -> None:
    assert sample_seed(17, 0, 5) == sample_seed(17, 0, 5)
    assert (
        len({sample_seed(17, 0, 5), sample_seed(17, 1, 5), sample_seed(18, 0, 5), sample_seed(17, 0, 6)}) == 4
    )
    assert 0 <= sample_seed(17, 3, 10**9) < 2**63


def test_draws_are_per_sample_not_per_batch() -> None:
    seeds = [sample_seed(1, 0, i) for i in range(6)]
    together = draw_for_samples(torch.tensor(seeds), LATENT, 1000)
    apart = [draw_for_samples(torch.tensor([s]), LATENT, 1000) for s in reversed(seeds)]
    for i, one in enumerate(reversed(apart)):
        assert torch.equal(together.noise[i], one.noise[0])
        assert torch.equal(together.latent_eps[i], one.latent_eps[0])
        assert int(together.timesteps[i]) == int(one.timesteps[0])
        assert float(together.coin[i]) == float(one.coin[0])
    assert not torch.equal(together.noise[0], together.noise[1])


def test_prepare_is_deterministic_and_ignores_global_rng() -> None:
    obj = objective()
    batch = make_batch([11, 12, 13])
    torch.manual_seed(0)
    first = obj.prepare(batch)
    torch.manual_seed(123)
    torch.rand(100)
    second = obj.prepare(batch)
    for a, b in zip(
        (first.noisy, first.target, first.text, first.timesteps),
        (second.noisy, second.target, second.text, second.timesteps),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_caption_dropout_rate_is_about_ten_percent_and_fixed_per_sample() -> None:
    obj = objective(caption_dropout=0.1)
    seeds = [sample_seed(17, 0, i) for i in range(4000)]
    text = torch.randn((len(seeds), *TEXT)).half()
    coins = draw_for_samples(torch.tensor(seeds), LATENT, 1000).coin
    dropped = (obj.drop_captions(text.float(), coins).abs().sum(dim=(1, 2)) == 0).float()
    assert 0.085 < dropped.mean().item() < 0.115
    again = (
        obj.drop_captions(text.float(), draw_for_samples(torch.tensor(seeds), LATENT, 1000).coin)
        .abs()
        .sum(dim=(1, 2))
        == 0
    )
    assert torch.equal(dropped.bool(), again)


def test_dropped_captions_use_the_manifest_empty_embedding() -> None:
    empty = torch.full(TEXT, 3.0)
    obj = Objective(ModelConfig(preset="tiny", caption_dropout=0.999), 1.0, empty)
    out = obj.prepare(make_batch([1, 2, 3, 4]))
    assert torch.equal(out.text, empty.expand(4, -1, -1))


def test_latents_are_sampled_then_scaled_once() -> None:
    obj = objective()
    mean = torch.full((1, *LATENT), 2.0)
    logvar = torch.full((1, *LATENT), np.log(0.25))  # std 0.5
    eps = torch.ones((1, *LATENT))
    assert torch.allclose(obj.sample_latents(mean, logvar, eps), torch.full((1, *LATENT), (2.0 + 0.5) * 0.5))


def test_epsilon_and_v_targets() -> None:
    batch = make_batch([5, 6])
    eps_out = objective(prediction_type="epsilon").prepare(batch)
    v_obj = objective(prediction_type="v_prediction")
    v_out = v_obj.prepare(batch)
    draws = draw_for_samples(batch[SAMPLE_SEED], LATENT, 1000)
    latents = v_obj.sample_latents(batch[LATENT_MEAN], batch[LATENT_LOGVAR], draws.latent_eps)
    ac = v_obj.alphas_cumprod[draws.timesteps][:, None, None, None]
    assert torch.allclose(eps_out.target, draws.noise)
    assert torch.allclose(v_out.target, ac.sqrt() * draws.noise - (1 - ac).sqrt() * latents, atol=1e-6)
    assert torch.allclose(v_out.noisy, ac.sqrt() * latents + (1 - ac).sqrt() * draws.noise, atol=1e-6)


def test_sd2_schedule_matches_diffusers_scaled_linear() -> None:
    ac = training_alphas_cumprod(ModelConfig())
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float32) ** 2
    assert torch.allclose(ac, torch.cumprod(1 - betas, 0), rtol=1e-5)


def test_zero_terminal_snr_makes_last_step_pure_noise() -> None:
    ac = training_alphas_cumprod(ModelConfig(zero_terminal_snr=True, prediction_type="v_prediction"))
    assert ac[-1].item() == pytest.approx(0.0, abs=1e-12)
    assert ac[0].item() > 0.99


def test_min_snr_gamma_weights() -> None:
    obj = objective(min_snr_gamma=5.0)
    t = torch.tensor([0, 500, 999])
    ac = obj.alphas_cumprod[t]
    snr = ac / (1 - ac)
    assert torch.allclose(obj.loss_weight(t), snr.clamp(max=5.0) / snr)
    v = objective(min_snr_gamma=5.0, prediction_type="v_prediction")
    assert torch.allclose(v.loss_weight(t), snr.clamp(max=5.0) / (snr + 1))
    assert torch.equal(objective().loss_weight(t), torch.ones(3))


def test_offset_noise_only_changes_noise_when_enabled() -> None:
    batch = make_batch([7])
    plain, offset = objective().prepare(batch), objective(offset_noise=0.1).prepare(batch)
    assert torch.equal(plain.timesteps, offset.timesteps)
    delta = (offset.target - plain.target)[0]
    assert delta.abs().sum() > 0
    assert torch.allclose(delta, delta[:, :1, :1].expand_as(delta), atol=1e-6)  # constant per channel
