"""FID, KID and CLIP score, computed by torchmetrics and open_clip from uint8 image pixels.

One Inception network (torchmetrics' `NoTrainInceptionV3`, torch-fidelity's FID Inception, loaded from the
standard weights file the user supplies: no download) extracts 2048-d pool features once per image. FID and
KID then run on those features through torchmetrics' own metrics, given an identity feature extractor: the
same numbers as `FrechetInceptionDistance(feature=net)` / `KernelInceptionDistance(feature=net)` on the
images, while the reference features are extracted once and cached (train/eval/reference.py). torchmetrics
1.7's KID takes no weights path, which this also gets around.

CLIP score is torchmetrics' definition, 100 * max(cos(image embedding, text embedding), 0) averaged over
images, with an open_clip model from a `local-dir:` folder (open_clip_config.json + weights); torchmetrics'
`CLIPScore` only takes Hugging Face CLIP models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shared.config import ConfigError

FEATURES = 2048  # Inception pool3, the standard FID feature
CLIP_CONFIG = "open_clip_config.json"  # open_clip's `local-dir:` model folder: this + the weights
INCEPTION_FILE = "pt_inception-2015-12-05-6726825d.pth"  # torch-fidelity's FID Inception weights
KID_SUBSETS = 100  # torchmetrics' default
KID_MAX_SUBSET = 1000  # torchmetrics' default subset size, lowered to the sample count when smaller


def inception(weights_path: str, device: str = "cpu") -> torch.nn.Module:
    from torchmetrics.image.fid import NoTrainInceptionV3

    if not Path(weights_path).is_file():
        raise ConfigError(
            f"--inception-weights {weights_path} is not a file: pass the standard FID Inception weights "
            f"({INCEPTION_FILE}, the file torch-fidelity downloads)"
        )
    net = NoTrainInceptionV3(
        name="inception-v3-compat", features_list=[str(FEATURES)], feature_extractor_weights_path=weights_path
    )
    return net.to(device).eval()


@torch.no_grad()
def extract(net: torch.nn.Module, images: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """[N, 2048] float32 features of uint8 [N, 3, H, W] images (the network resizes to 299 itself)."""
    device = next(net.parameters()).device
    parts = [net(images[i : i + batch].to(device)).float().cpu() for i in range(0, len(images), batch)]
    return torch.cat(parts).reshape(len(images), FEATURES)


# The metrics run on rank 0 alone, with every feature already here: under torchrun a metric's default
# sync_on_compute would wait for the other ranks, which have finished.


class Features(torch.nn.Module):
    """The feature extractor torchmetrics is given: features were extracted already."""

    num_features = FEATURES

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features


def fid(real: torch.Tensor, fake: torch.Tensor) -> float:
    from torchmetrics.image.fid import FrechetInceptionDistance

    metric = FrechetInceptionDistance(feature=Features(), sync_on_compute=False)
    metric.update(real, real=True)
    metric.update(fake, real=False)
    return float(metric.compute())


def kid_subset_size(real: int, fake: int) -> int:
    return min(KID_MAX_SUBSET, real, fake)


def kid(real: torch.Tensor, fake: torch.Tensor, seed: int = 0) -> tuple[float, float]:
    """(mean, std) over KID_SUBSETS subsets; the subsets are drawn from `seed` (torch's global RNG is
    restored after)."""
    from torchmetrics.image.kid import KernelInceptionDistance

    metric = KernelInceptionDistance(
        feature=Features(),
        subsets=KID_SUBSETS,
        subset_size=kid_subset_size(len(real), len(fake)),
        sync_on_compute=False,
    )
    metric.update(real, real=True)
    metric.update(fake, real=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mean, std = metric.compute()
    return float(mean), float(std)


class ClipScorer:
    """An open_clip model from a `local-dir:` folder and its own preprocessing and tokenizer."""

    def __init__(self, path: str, device: str = "cpu"):
        import open_clip

        if not (Path(path) / CLIP_CONFIG).is_file():
            raise ConfigError(
                f"--clip-model {path} is not an open_clip model folder (open_clip_config.json + "
                "open_clip_model.safetensors, as open_clip's `local-dir:` loads it)"
            )
        self.model, _, self.preprocess = open_clip.create_model_and_transforms(f"local-dir:{path}")
        self.model = self.model.to(device).eval()
        self.tokenizer = open_clip.get_tokenizer(f"local-dir:{path}")
        self.device = device

    @torch.no_grad()
    def scores(self, images: list[Any], prompts: list[str], batch: int = 32) -> torch.Tensor:
        """[N] per-image 100 * max(cos, 0) of PIL images against their prompts."""
        out = []
        for i in range(0, len(images), batch):
            pixels = torch.stack([self.preprocess(image) for image in images[i : i + batch]])
            image = self.model.encode_image(pixels.to(self.device)).float()
            text = self.model.encode_text(self.tokenizer(prompts[i : i + batch]).to(self.device)).float()
            cos = torch.nn.functional.cosine_similarity(image, text, dim=-1)
            out.append((100 * cos).clamp(min=0).cpu())
        return torch.cat(out)
