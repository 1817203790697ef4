"""Eval fixtures: an Inception weights file of the standard FID format with random weights, a tiny open_clip
model folder in the `local-dir:` layout, a tiny export of the session's training run and reference images
(no downloads: every model is built here from a config)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train.conftest import TinyRun, single_threaded_torch

CLIP_CFG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def write_random_inception(path: Path) -> Path:
    """torch-fidelity's FID Inception with random weights, saved as its weights file is (a state dict)."""
    import torch_fidelity.feature_extractor_inceptionv3 as fe

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fe, "load_state_dict_from_url", lambda *a, **k: {})
        mp.setattr(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda self, *a, **k: None)
        torch.manual_seed(0)
        net = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    for module in net.modules():  # He init: features of O(1) size through ~90 layers (torch's default
        if isinstance(module, torch.nn.Conv2d):  # init shrinks them to ~1e-8, where every FID is ~0)
            torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    torch.save(net.state_dict(), path)
    return path


def write_tiny_clip(folder: Path) -> Path:
    import open_clip
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = open_clip.model.CLIP(**CLIP_CFG)
    folder.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, folder / "open_clip_model.safetensors"
    )
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": CLIP_CFG, "preprocess_cfg": {}}))
    return folder


def write_reference(folder: Path, count: int = 8) -> Path:
    """PNGs of other sizes than the generated 64 px (resized and cropped when read)."""
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        pixels = rng.integers(0, 256, (72 + 4 * i, 96, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"ref{i:03d}.png")
    return folder


@pytest.fixture(scope="session")
def inception_weights(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_random_inception(tmp_path_factory.mktemp("inception") / "pt_inception-random.pth"))


@pytest.fixture(scope="session")
def clip_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip"))


@pytest.fixture(scope="session")
def reference_images(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_reference(tmp_path_factory.mktemp("reference") / "images"))


@pytest.fixture(scope="session")
def exported_model(tiny_run: TinyRun, tmp_path_factory: pytest.TempPathFactory) -> str:
    from train.export.pipeline import export_pipeline

    out = tmp_path_factory.mktemp("export") / "pipeline"
    with single_threaded_torch():
        export_pipeline(str(tiny_run.save), str(out))
    return str(out)
