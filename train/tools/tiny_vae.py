"""Train the `tiny` preset's VAE on the bundled sample data and ship it in shared/assets.

    python -m train tiny-vae [--out shared/assets] [--steps N] [--seed 0] [--grid-dir DIR]   (make tiny-vae)

A random-init VAE decodes noise, so without this the demo's sample grid would show nothing a person (or a
test) could judge. The sample images are flat-coloured shapes with a little noise, so the small
`diffusers.AutoencoderKL` of the preset's `TINY_VAE` (downsample 8, 4 latent channels, like SD's) learns
them in minutes on one CPU core:
- data: `encode.sample_data.build_webdataset` for TRAIN_DATA_SEEDS, decoded, resized and center-cropped
  exactly as encode does (`encode.process.images`) at 64 and 128 px; PSNR is measured on a seed never
  trained on;
- batches: whole images, one resolution per step (alternating), randomly flipped. Not crops: GroupNorm
  normalises over the whole image, so a crop (often one flat colour) is not what encode feeds the network,
  and on a flat crop the normalisation erases the very colour it should keep;
- loss: L1 in pixel space + KL_WEIGHT * KL, both means per element (see KL_WEIGHT);
- afterwards `scaling_factor` = 1 / std of sampled latents over the bundled sample data (how SD's 0.18215
  was chosen), measured with the fp16 weights that ship, as is everything else in the JSON.

Writes OUT/tiny_vae.safetensors (fp16) and OUT/tiny_vae.json (scaling factor, PSNR, sha256, ...).
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encode.config import SourceConfig
from encode.process.images import decode_rgb, resize_center_crop
from encode.sample_data import build_webdataset
from encode.sources import RawSample, read_webdataset
from shared.presets import TINY_VAE

WEIGHTS_NAME = "tiny_vae.safetensors"
INFO_NAME = "tiny_vae.json"
RESOLUTIONS = (64, 128)  # what jobs/datasets/sample.yaml encodes
RESAMPLE = "bicubic"  # encode's default transform.resample
MAX_PIXELS = 1 << 26
# Seed 0 is exactly the data `make demo` encodes (and what the scaling factor is measured on); seed 1 adds
# shape/colour/position combinations it lacks, so the VAE does not fit seed 0's particular images.
TRAIN_DATA_SEEDS = (0, 1)
SHARDS, PER_SHARD = 4, 128  # build_webdataset's defaults: 512 images per seed
HELDOUT_SEED = 1000  # never trained on: the JSON's PSNR is measured on these
HELDOUT_PER_SHARD = 64
DEFAULT_STEPS = 1500
PIXELS_PER_BATCH = 16 * 64 * 64  # 16 images at 64 px, 4 at 128 px
LEARNING_RATE = 5e-4  # 2e-3 plateaued near 10 dB for 600 steps with this VAE
WARMUP_STEPS = 50
FINAL_LR_FRACTION = 0.05  # cosine decay to this fraction of LEARNING_RATE
ADAM_BETAS = (0.9, 0.999)  # LDM's (0.5, 0.9) was ~2 dB worse at this budget
GRAD_CLIP = 1.0
# Both loss terms are means per element (pixels in [-1, 1]; latent elements). SD's kl_weight 1e-6 weighed
# *sums* over 512x512x3 pixels against 64x64x4 latents, i.e. ~2e-8 per element: that leaves the latent
# scale free (SD's latents have std ~5.5) and the posterior noise negligible. 1e-4 keeps the latent std
# near 2 and the posterior noise at ~10% of it, so the decoder learns to tolerate small latent errors, which
# is what a diffusion model's imperfect samples look like to it; the KL term is ~1% of the loss, so it
# costs reconstruction little.
KL_WEIGHT = 1e-4
# One thread: these small convolutions gain little from a second, a shared machine's OpenMP barriers made
# two threads up to 10x slower (measured), and one thread gives the same numbers on any core count.
TORCH_THREADS = 1
SCALE_NOISE_SEED = 1234  # posterior noise for the scaling-factor statistics
EVAL_BATCH = 32
UINT8_HALF = 127.5


@dataclass(frozen=True)
class ImageSets:
    """uint8 NCHW images per resolution (a resolution no image reaches is absent)."""

    by_resolution: dict[int, torch.Tensor]

    def count(self) -> dict[str, int]:
        return {str(res): len(images) for res, images in self.by_resolution.items()}

    def merged_with(self, other: ImageSets) -> ImageSets:
        keys = sorted(set(self.by_resolution) | set(other.by_resolution))
        parts = {res: [s.by_resolution[res] for s in (self, other) if res in s.by_resolution] for res in keys}
        return ImageSets({res: torch.cat(tensors) for res, tensors in parts.items()})


# ------------------------------------------------------------------------------------------------ data
def read_tar_images(tar_path: Path) -> list[bytes]:
    """The image bytes of every sample of one webdataset tar, in order, read by encode's own reader."""
    samples = read_webdataset(str(tar_path), SourceConfig())
    return [s.image for s in samples if isinstance(s, RawSample) and s.image]


def sample_images(seed: int, shards: int = SHARDS, per_shard: int = PER_SHARD) -> ImageSets:
    """The bundled sample data for `seed`, resized + center-cropped at every resolution as encode does.

    Images smaller than a resolution are left out of it (encode never upscales either).
    """
    collected: dict[int, list[np.ndarray]] = {res: [] for res in RESOLUTIONS}
    with tempfile.TemporaryDirectory(prefix="tiny-vae-data-") as tmp:
        for tar_path in build_webdataset(Path(tmp), shards, per_shard, seed):
            for data in read_tar_images(tar_path):
                img = decode_rgb(data, MAX_PIXELS)
                for res in RESOLUTIONS:
                    pixels = resize_center_crop(img, res, RESAMPLE)
                    if pixels is not None:
                        collected[res].append(pixels)
    return ImageSets(
        {
            res: torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).contiguous()
            for res, imgs in collected.items()
            if imgs
        }
    )


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW -> float32 in [-1, 1], as encode.process.images.to_model_input does per image."""
    return images.float() / UINT8_HALF - 1.0


def image_batch(sets: ImageSets, step: int, rng: np.random.Generator) -> torch.Tensor:
    """Whole images of one resolution (alternating by step), PIXELS_PER_BATCH pixels, randomly flipped."""
    resolutions = sorted(sets.by_resolution)
    res = resolutions[step % len(resolutions)]
    images = sets.by_resolution[res]
    picked = images[torch.from_numpy(rng.choice(len(images), size=max(1, PIXELS_PER_BATCH // res**2)))]
    flip = torch.from_numpy(rng.random(len(picked)) < 0.5)
    return to_unit_range(torch.where(flip[:, None, None, None], picked.flip(-1), picked))


# ------------------------------------------------------------------------------------------- training
def build_untrained_vae(seed: int) -> Any:
    """TINY_VAE's AutoencoderKL, random-init from `seed` (the global RNG is left as it was)."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(**TINY_VAE)


def learning_rate(step: int, steps: int) -> float:
    """Linear warmup, then cosine decay to FINAL_LR_FRACTION of LEARNING_RATE."""
    if step < WARMUP_STEPS:
        return LEARNING_RATE * (step + 1) / WARMUP_STEPS
    progress = min(1.0, (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS))
    floor = LEARNING_RATE * FINAL_LR_FRACTION
    return floor + (LEARNING_RATE - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def vae_loss(vae: Any, batch: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """L1 reconstruction of a sampled posterior + KL_WEIGHT * KL, both means per element."""
    posterior = vae.encode(batch).latent_dist
    recon = vae.decode(posterior.sample(generator=generator)).sample
    rec = (recon - batch).abs().mean()
    kl = posterior.kl().sum() / posterior.mean.numel()
    return {"loss": rec + KL_WEIGHT * kl, "l1": rec.detach(), "kl": kl.detach()}


def train_vae(vae: Any, sets: ImageSets, steps: int, seed: int, log_every: int = 100) -> list[dict]:
    """AdamW over `steps` batches; returns the logged (step, l1, kl) history."""
    vae.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=LEARNING_RATE, betas=ADAM_BETAS, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps)
        terms = vae_loss(vae, image_batch(sets, step, rng), generator)
        optimizer.zero_grad(set_to_none=True)
        terms["loss"].backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), GRAD_CLIP)
        optimizer.step()
        if step % log_every == 0 or step == steps - 1:
            entry = {"step": step, "l1": float(terms["l1"]), "kl": float(terms["kl"])}
            history.append(entry)
            print(f"step {step:5d}/{steps}  l1 {entry['l1']:.4f}  kl {entry['kl']:.3f}", flush=True)
    return history


# ------------------------------------------------------------------------------------------ evaluation
@torch.inference_mode()
def reconstruct(vae: Any, images: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW -> uint8 NCHW through the posterior mean (what decoding a clean latent gives)."""
    vae.eval()
    out = []
    for start in range(0, len(images), EVAL_BATCH):
        batch = to_unit_range(images[start : start + EVAL_BATCH])
        decoded = vae.decode(vae.encode(batch).latent_dist.mean).sample
        out.append(((decoded.clamp(-1, 1) + 1) * UINT8_HALF).round().to(torch.uint8))
    return torch.cat(out)


def psnr(original: torch.Tensor, reconstructed: torch.Tensor) -> float:
    """Mean over images of per-image PSNR in dB (peak 255)."""
    mse = (original.float() - reconstructed.float()).pow(2).flatten(1).mean(1).clamp_min(1e-10)
    return float((10 * torch.log10(255.0**2 / mse)).mean())


@torch.inference_mode()
def sampled_latents(vae: Any, images: torch.Tensor, seed: int = SCALE_NOISE_SEED) -> torch.Tensor:
    """Unscaled latents, flattened, as training draws them: posterior mean + std * eps (fixed noise)."""
    vae.eval()
    generator = torch.Generator().manual_seed(seed)
    chunks = []
    for start in range(0, len(images), EVAL_BATCH):
        posterior = vae.encode(to_unit_range(images[start : start + EVAL_BATCH])).latent_dist
        chunks.append(posterior.sample(generator=generator).flatten())
    return torch.cat(chunks)


def scaling_factor(vae: Any, sets: ImageSets) -> float:
    """1 / std of sampled latents over every image at every resolution (as SD's 0.18215 was chosen)."""
    latents = torch.cat([sampled_latents(vae, images) for images in sets.by_resolution.values()])
    return float(1.0 / latents.std())


def comparison_grid(original: torch.Tensor, recon: torch.Tensor, path: Path, columns: int = 12) -> Path:
    """A PNG: `columns` originals on top, their reconstructions below."""
    from PIL import Image

    count = min(columns, len(original))
    rows = [torch.cat(list(images[:count]), dim=-1) for images in (original, recon)]
    grid = torch.cat(rows, dim=-2).permute(1, 2, 0).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.ascontiguousarray(grid)).save(path)
    return path


# --------------------------------------------------------------------------------------------- output
def sha256_of(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_fp16_weights(vae: Any, path: Path) -> str:
    """Write fp16 safetensors and load them back into `vae`, so every number measured afterwards is the
    shipped model's; returns the file's sha256."""
    from safetensors.torch import load_file, save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to(torch.float16).contiguous() for name, t in vae.state_dict().items()}
    save_file(state, str(path))
    vae.load_state_dict(load_file(str(path)))
    return sha256_of(path)


def run(
    out: Path,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    per_shard: int = PER_SHARD,
    grid_dir: Path | None = None,
) -> dict[str, Any]:
    """Train, save the weights, measure them, write the JSON; returns what the JSON holds."""
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    try:
        bundled = sample_images(TRAIN_DATA_SEEDS[0], SHARDS, per_shard)
        train_sets = bundled
        for data_seed in TRAIN_DATA_SEEDS[1:]:
            train_sets = train_sets.merged_with(sample_images(data_seed, SHARDS, per_shard))
        heldout = sample_images(HELDOUT_SEED, 1, min(per_shard, HELDOUT_PER_SHARD))
        vae = build_untrained_vae(seed)
        history = train_vae(vae, train_sets, steps, seed)
        digest = save_fp16_weights(vae, Path(out) / WEIGHTS_NAME)
        factor = scaling_factor(vae, bundled)
        psnrs = {}
        for res, images in heldout.by_resolution.items():
            recon = reconstruct(vae, images)
            psnrs[str(res)] = round(psnr(images, recon), 2)
            if grid_dir is not None:
                comparison_grid(images, recon, Path(grid_dir) / f"tiny_vae_{res}px.png")
    finally:
        torch.set_num_threads(threads)
    info = {
        "scaling_factor": round(factor, 5),
        "steps": steps,
        "seed": seed,
        "resolutions": list(RESOLUTIONS),
        "heldout_psnr_db": psnrs,
        "wall_time_s": round(time.perf_counter() - started, 1),
        "sha256": digest,
        "train_data_seeds": list(TRAIN_DATA_SEEDS),
        "train_images": train_sets.count(),
        "heldout_data_seed": HELDOUT_SEED,
        "heldout_images": heldout.count(),
        "loss": f"l1 + {KL_WEIGHT:g} * kl (means per element)",
        "final_l1": round(history[-1]["l1"], 5) if history else None,
        "params": sum(p.numel() for p in vae.parameters()),
        "torch": torch.__version__,
        "torch_threads": TORCH_THREADS,
    }
    (Path(out) / INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
    return info
