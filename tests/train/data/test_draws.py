"""The per-sample draws: splitmix64 on int64 tensors, turned into uniforms, timesteps and normals."""

from __future__ import annotations

import math

import pytest
import torch

from tests.train.loop.test_clipping import top_level_aten_ops
from train.data.draws import (
    _GAMMA,
    _MIX1,
    _MIX2,
    KIND_COIN,
    KIND_LATENT_EPS,
    KIND_NOISE,
    KIND_OFFSET,
    KIND_TIMESTEP,
    draw_for_samples,
    hash_bits,
    hash_kinds,
    integers,
    normal,
    uniform,
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


@pytest.mark.parametrize("latent", [LATENT, (3, 5, 7)], ids=["square", "odd"])
def test_kinds_hashed_together_are_the_kind_by_kind_draws_bit_for_bit(latent: tuple[int, ...]) -> None:
    seeds = torch.tensor(EDGE_SEEDS)
    counts = ((KIND_NOISE, 7), (KIND_COIN, 1), (KIND_OFFSET, 3))
    for (kind, n), bits in zip(counts, hash_kinds(seeds, counts), strict=True):
        assert torch.equal(bits, hash_bits(seeds, kind, n)), kind
    draws = draw_for_samples(seeds, latent, 1000)
    assert torch.equal(draws.coin, uniform(seeds, KIND_COIN))
    assert torch.equal(draws.timesteps, integers(seeds, KIND_TIMESTEP, 1000))
    assert torch.equal(draws.latent_eps, normal(seeds, KIND_LATENT_EPS, latent))
    assert torch.equal(draws.noise, normal(seeds, KIND_NOISE, latent))
    assert torch.equal(draws.offset, normal(seeds, KIND_OFFSET, latent[:1]))


def test_a_batchs_draws_dispatch_a_fixed_number_of_ops() -> None:
    """Each op is a kernel launch on a GPU, outside the compiled U-Net, every step: kind by kind the
    hashing alone took ~130 (218 in all at SD2's latents); hashed together, 98 in all."""
    seeds = torch.arange(8) * 7 + 3
    counts = []
    for shape in (LATENT, (4, 64, 64)):
        draw_for_samples(seeds, shape, 1000)  # the first call of a shape builds its cached counters
        counts.append(top_level_aten_ops(lambda s=shape: draw_for_samples(seeds, s, 1000)))
    assert counts[0] == counts[1] <= 100, counts


@pytest.mark.gpu
def test_draws_on_a_gpu_match_the_host() -> None:
    """Same bits on the device (integer ops); the normals to float32 rounding of log / cos."""
    seeds = torch.tensor(EDGE_SEEDS)
    host = draw_for_samples(seeds, LATENT, 1000)
    device = draw_for_samples(seeds.cuda(), LATENT, 1000)
    assert torch.equal(hash_bits(seeds.cuda(), KIND_NOISE, 64).cpu(), hash_bits(seeds, KIND_NOISE, 64))
    assert torch.equal(device.timesteps.cpu(), host.timesteps) and torch.equal(device.coin.cpu(), host.coin)
    torch.testing.assert_close(device.noise.cpu(), host.noise, rtol=1e-5, atol=1e-5)
