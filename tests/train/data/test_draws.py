"""The per-sample draws: splitmix64 on int64 tensors, turned into uniforms, timesteps and normals."""

from __future__ import annotations

import math

import pytest
import torch

from train.data.draws import (
    _GAMMA,
    _MIX1,
    _MIX2,
    KIND_LATENT_EPS,
    KIND_NOISE,
    draw_for_samples,
    hash_bits,
    normal,
)

MASK = (1 << 64) - 1
LATENT = (4, 16, 16)
EDGE_SEEDS = [0, 1, 2**62, 2**63 - 1, 123456789]


def reference_mix(z: int) -> int:
    """splitmix64's mixer on Python ints (unbounded, masked to 64 bits): what the tensors must match."""
    z = ((z ^ (z >> 30)) * _MIX1) & MASK
    z = ((z ^ (z >> 27)) * _MIX2) & MASK
    return z ^ (z >> 31)


def reference_bits(seed: int, kind: int, i: int) -> int:
    key = reference_mix((seed + kind * _GAMMA) & MASK)
    return reference_mix((key + (i + 1) * _GAMMA) & MASK)


def test_int64_tensor_hash_is_splitmix64_bit_for_bit() -> None:
    """Wrapping int64 multiplies and masked shifts reproduce the unsigned 64-bit reference."""
    bits = hash_bits(torch.tensor(EDGE_SEEDS), KIND_NOISE, 7)
    for row, seed in enumerate(EDGE_SEEDS):
        for i in range(7):
            assert int(bits[row, i]) & MASK == reference_bits(seed, KIND_NOISE, i), (seed, i)


def test_normals_are_standard_and_independent_across_samples_and_kinds() -> None:
    seeds = torch.arange(512) * 7919 + 11
    noise = normal(seeds, KIND_NOISE, LATENT)
    eps = normal(seeds, KIND_LATENT_EPS, LATENT)
    flat = noise.flatten().double()
    assert abs(flat.mean()) < 0.005 and abs(flat.std() - 1) < 0.005  # 131k values: 5 sigma is 0.014
    # Kolmogorov-Smirnov distance to the normal CDF (critical value at 1e-6: ~0.007 for 131k values)
    ordered = flat.sort().values
    cdf = 0.5 * (1 + torch.erf(ordered / math.sqrt(2)))
    ranks = torch.arange(1, len(ordered) + 1, dtype=torch.float64) / len(ordered)
    assert (cdf - ranks).abs().max() < 0.007
    assert flat.abs().max() <= 5.8  # Box-Muller on 24-bit uniforms
    per_sample = noise.flatten(1)
    neighbours = (per_sample[1:] * per_sample[:-1]).mean(dim=1)
    assert neighbours.abs().max() < 5 / math.sqrt(per_sample.shape[1])  # each ~N(0, 1/32): samples unrelated
    assert abs(float((noise * eps).mean())) < 0.01  # two kinds of one seed are unrelated
    assert abs(float((flat[1:] * flat[:-1]).mean())) < 0.01  # neighbouring elements too


def test_coins_and_timesteps_are_uniform() -> None:
    draws = draw_for_samples(torch.arange(20000) * 31 + 5, LATENT, 1000)
    assert float(draws.coin.min()) >= 0 and float(draws.coin.max()) < 1
    assert abs(float(draws.coin.mean()) - 0.5) < 0.01
    assert draws.timesteps.dtype == torch.int64
    assert int(draws.timesteps.min()) == 0 and int(draws.timesteps.max()) == 999
    counts = torch.bincount(draws.timesteps // 100, minlength=10).double()
    assert ((counts - 2000).abs() < 200).all()  # each tenth of the schedule: 2000 +- 4.7 sigma


def test_a_seed_gives_the_same_draws_in_any_batch() -> None:
    together = draw_for_samples(torch.tensor(EDGE_SEEDS), LATENT, 1000)
    for i, seed in enumerate(EDGE_SEEDS):
        alone = draw_for_samples(torch.tensor([seed]), LATENT, 1000)
        for field in ("coin", "timesteps", "latent_eps", "noise", "offset"):
            assert torch.equal(getattr(together, field)[i], getattr(alone, field)[0]), field


@pytest.mark.gpu
def test_draws_on_a_gpu_match_the_host() -> None:
    """Same bits on the device (integer ops); the normals to float32 rounding of log / cos."""
    seeds = torch.tensor(EDGE_SEEDS)
    host = draw_for_samples(seeds, LATENT, 1000)
    device = draw_for_samples(seeds.cuda(), LATENT, 1000)
    assert torch.equal(hash_bits(seeds.cuda(), KIND_NOISE, 64).cpu(), hash_bits(seeds, KIND_NOISE, 64))
    assert torch.equal(device.timesteps.cpu(), host.timesteps) and torch.equal(device.coin.cpu(), host.coin)
    torch.testing.assert_close(device.noise.cpu(), host.noise, rtol=1e-5, atol=1e-5)
