"""eval-images' scores and report: FID/KID/CLIP score per guidance scale from the saved PNGs, metrics.json
and the SD2-style trade-off plot (FID against CLIP score, one point per guidance scale)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from shared.storage import private_temp_dir
from train.eval.quality import ClipScorer, extract, fid, inception, kid, kid_subset_size
from train.eval.reference import reference_features

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
PLOT_FILE = "fid_vs_clip.png"


def guidance_name(scale: float) -> str:
    """`1.5` -> "1.5", `4.0` -> "4": the folder and metrics.json key of a scale."""
    return f"{scale:g}"


def read_pngs(folder: Path, count: int) -> list[Any]:
    from PIL import Image

    images = []
    for i in range(count):
        with Image.open(folder / f"{i}.png") as image:
            images.append(image.convert("RGB"))
    return images


def to_uint8(images: list[Any]) -> torch.Tensor:
    import numpy as np

    return torch.stack([torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1) for image in images])


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def score_and_report(spec: Any, prompts: list[str], device: str) -> dict[str, Any]:
    """Score the images an ImageEvalSpec (train/eval/images.py) wrote; write metrics.json and the plot."""
    net = inception(spec.inception_weights, device)
    first = read_pngs(Path(spec.out) / "images" / guidance_name(spec.guidance[0]), 1)[0]
    # The generated size: square as before, or a bucket's (eval-images --size HxW)
    size = first.height if first.height == first.width else (first.height, first.width)
    cache = spec.cache_dir or str(private_temp_dir("sd-pretrain-fid", "--cache-dir"))
    real, cached = reference_features(
        spec.reference, spec.num_reference, size, spec.inception_weights, lambda x: extract(net, x), cache
    )
    clip = ClipScorer(spec.clip_model, device)
    results: dict[str, Any] = {}
    for scale in spec.guidance:
        images = read_pngs(Path(spec.out) / "images" / guidance_name(scale), spec.num_images)
        fake = extract(net, to_uint8(images))
        kid_mean, kid_std = kid(real, fake, spec.seed)
        results[guidance_name(scale)] = {
            "fid": fid(real, fake),
            "kid": kid_mean,
            "kid_std": kid_std,
            "clip_score": float(clip.scores(images, prompts).mean()),
        }
        log.info("guidance %s: %s", guidance_name(scale), results[guidance_name(scale)])
    report = {
        "guidance": results,
        "num_images": spec.num_images,
        "num_reference": len(real),
        "kid_subset_size": kid_subset_size(len(real), spec.num_images),
        "steps": spec.steps,
        "seed": spec.seed,
        "image_size": size,
        "model": spec.model,
        "reference_cached": cached,
    }
    write_json(Path(spec.out) / METRICS_FILE, report)
    plot_tradeoff(results, Path(spec.out) / PLOT_FILE)
    return report


def plot_tradeoff(results: dict[str, dict[str, float]], path: Path) -> None:
    """FID (lower is better) against CLIP score (higher is better), a point per guidance scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = list(results)
    clip = [results[s]["clip_score"] for s in scales]
    fids = [results[s]["fid"] for s in scales]
    fig, ax = plt.subplots(figsize=(5, 4), dpi=120)
    ax.plot(clip, fids, marker="o")
    for scale, x, y in zip(scales, clip, fids, strict=True):
        ax.annotate(f"w={scale}", (x, y), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("CLIP score")
    ax.set_ylabel("FID")
    ax.set_title("FID vs CLIP score over guidance scale")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(path.parent, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
