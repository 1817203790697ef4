"""Every random number a training sample needs, a pure function of its seed, computed where the batch is.

A row carries one seed (`sample_seed`: a hash of the run's seed, the epoch, the sample index and its
copy). Each draw of that sample is a counter-based hash of (seed, draw kind, element index) - splitmix64's
mixer on int64 tensors - turned into a uniform or a normal. So:
- the draws depend on nothing but the seed: not on ranks, workers, batch splits, resumes or the device's RNG
  state (resumed runs are exact);
- they are plain elementwise tensor ops on the batch's device: the step reads nothing back (issue 11), and
  nothing per sample happens on the host. The loader's workers no longer draw (they did, with one
  torch.Generator per sample: ~45 us a sample on the host, and 2 latent-sized float32 tensors a sample
  through shared memory, pinning and the host-to-device copy, more bytes than the stored latents);
- each kind has its own counter stream: adding a draw never shifts another;
- a batch's kinds are hashed together (`hash_kinds`: one pass of the mixer over every counter of every kind,
  the same bits as hashing kind by kind): 98 top-level ops a step at SD2's latents where kind by kind took
  218, each a kernel launch on a GPU, outside the compiled U-Net.

Normals come from Box-Muller over two 24-bit uniforms of one hash, computed in float32: |z| <= 5.77 (a
true normal passes that once in ~10^8 values), otherwise standard normal (tested).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch

SAMPLE_SEED = "sample_seed"  # int64 batch column: the seed of every random draw for that sample
_SEED_MASK = (1 << 63) - 1  # a non-negative 63-bit seed: any int64 tensor holds it

# Draw kinds: the first word of each kind's counter stream (part of resume exactness: never renumber).
KIND_COIN = 1  # [B] float32 uniform in [0, 1): caption dropout when < p
KIND_TIMESTEP = 2  # [B] int64 in [0, T)
KIND_LATENT_EPS = 3  # [B, C, H, W] float32: posterior sample noise
KIND_NOISE = 4  # [B, C, H, W] float32: diffusion noise
KIND_OFFSET = 5  # [B, C] float32: offset-noise direction

_U64 = 1 << 64
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio in 64 bits)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_BITS = 24  # float32 holds 24 significant bits: uniforms are k / 2^24
_SCALE = 1.0 / (1 << _BITS)


def seed_of(*parts: object) -> int:
    """A seed that is a pure function of `parts` (joined with ":"), never of ranks, workers or resumes."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def sample_seed(seed: int, epoch: int, index: int, copy: int = 0) -> int:
    """The seed of every random draw of one copy of a sample in one epoch: independent of ranks, resumes."""
    return seed_of(seed, epoch, index, *([copy] if copy else []))


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores (tensors wrap on overflow; Python scalars must fit)."""
    value %= _U64
    return value - _U64 if value >= 1 << 63 else value


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic: mask the sign copies away)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output mixer on an int64 tensor (wrapping multiply, as on every torch device)."""
    x = (x ^ _shr(x, 30)) * _signed(_MIX1)
    x = (x ^ _shr(x, 27)) * _signed(_MIX2)
    return x ^ _shr(x, 31)


def hash_bits(seeds: torch.Tensor, kind: int, count: int) -> torch.Tensor:
    """[B, count] int64 random bit patterns: element i of `kind` for each seed (splitmix64's i-th output
    from a state keyed by (seed, kind)). The definition, kind by kind; a step hashes its kinds together with
    `hash_kinds`, tested equal to this bit for bit."""
    key = mix64(seeds.to(torch.int64) + _signed(kind * _GAMMA))
    steps = torch.arange(1, count + 1, dtype=torch.int64, device=seeds.device) * _signed(_GAMMA)
    return mix64(key[:, None] + steps[None, :])


@functools.lru_cache(maxsize=16)
def _counters(counts: tuple[tuple[int, int], ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For `hash_kinds`: each kind's key offset [K], and per column its kind's index and its step [N] (built
    on the device by fills and aranges, no host copy; cached: the same every step)."""
    offsets = torch.cat(
        [torch.full((1,), _signed(kind * _GAMMA), dtype=torch.int64, device=device) for kind, _ in counts]
    )
    columns = torch.cat(
        [torch.full((n,), i, dtype=torch.int64, device=device) for i, (_, n) in enumerate(counts)]
    )
    steps = torch.cat([torch.arange(1, n + 1, dtype=torch.int64, device=device) for _, n in counts])
    return offsets, torch.stack([columns, steps * _signed(_GAMMA)])


def hash_kinds(seeds: torch.Tensor, counts: tuple[tuple[int, int], ...]) -> list[torch.Tensor]:
    """[B, count] bits for each (kind, count), in one pass: bit for bit `hash_bits(seeds, kind, count)`."""
    offsets, table = _counters(counts, seeds.device)
    keys = mix64(seeds.to(torch.int64)[:, None] + offsets[None, :])  # [B, K]
    bits = mix64(keys.index_select(1, table[0]) + table[1][None, :])  # [B, N]
    return list(bits.split([n for _, n in counts], dim=1))


def _top_bits(bits: torch.Tensor) -> torch.Tensor:
    return _shr(bits, 64 - _BITS)


def uniform_of(bits: torch.Tensor) -> torch.Tensor:
    """[B] float32 in [0, 1) from [B, 1] bits."""
    return _top_bits(bits)[:, 0].to(torch.float32) * _SCALE


def integers_of(bits: torch.Tensor, high: int) -> torch.Tensor:
    """[B] int64 in [0, high) from [B, 1] bits (multiply-shift: exact, bias below high / 2^24)."""
    return (_top_bits(bits)[:, 0] * high) >> _BITS


def normal_of(bits: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """[B, *shape] float32 standard normals from [B, prod(shape)] bits (Box-Muller, one normal per hash)."""
    u1 = (_top_bits(bits) + 1).to(torch.float32) * _SCALE  # (0, 1]: log never sees 0
    u2 = (_shr(bits, 64 - 2 * _BITS) & ((1 << _BITS) - 1)).to(torch.float32) * _SCALE
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z.view(bits.shape[0], *shape)


def uniform(seeds: torch.Tensor, kind: int) -> torch.Tensor:
    """[B] float32 in [0, 1), one per seed."""
    return uniform_of(hash_bits(seeds, kind, 1))


def integers(seeds: torch.Tensor, kind: int, high: int) -> torch.Tensor:
    """[B] int64 in [0, high), one per seed."""
    return integers_of(hash_bits(seeds, kind, 1), high)


def normal(seeds: torch.Tensor, kind: int, shape: tuple[int, ...]) -> torch.Tensor:
    """[B, *shape] float32 standard normals."""
    return normal_of(hash_bits(seeds, kind, math.prod(shape)), shape)


class MissingDrawsError(KeyError):
    """A batch reached the objective without its per-sample seeds."""


@dataclass
class SampleDraws:
    """The draws of a batch, one row per sample, on the seeds' device."""

    coin: torch.Tensor
    timesteps: torch.Tensor
    latent_eps: torch.Tensor
    noise: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def from_batch(
        cls, batch: dict[str, torch.Tensor], latent_shape: tuple[int, ...], num_timesteps: int
    ) -> SampleDraws:
        """The draws of a batch from its SAMPLE_SEED column."""
        if SAMPLE_SEED not in batch:
            raise MissingDrawsError(
                f"the batch has no {SAMPLE_SEED!r} column: batches come from train.data.loader, which gives "
                "every row the seed of its draws; a batch built by hand needs one int64 seed per sample"
            )
        return draw_for_samples(batch[SAMPLE_SEED], latent_shape, num_timesteps)


def draw_for_samples(seeds: torch.Tensor, latent_shape: tuple[int, ...], num_timesteps: int) -> SampleDraws:
    """Every draw of samples with these seeds (any device), for latents of `latent_shape` (C, H, W): the
    values of `uniform`, `integers` and `normal` kind by kind, from one hashing pass."""
    size = math.prod(latent_shape)
    counts = ((KIND_COIN, 1), (KIND_TIMESTEP, 1), (KIND_LATENT_EPS, size), (KIND_NOISE, size))
    coin, timestep, latent_eps, noise, offset = hash_kinds(seeds, (*counts, (KIND_OFFSET, latent_shape[0])))
    return SampleDraws(
        coin=uniform_of(coin),
        timesteps=integers_of(timestep, num_timesteps),
        latent_eps=normal_of(latent_eps, latent_shape),
        noise=normal_of(noise, latent_shape),
        offset=normal_of(offset, latent_shape[:1]),
    )
