"""shared/models.py with the tiny preset on CPU: both text backends agree, builders give the preset's shapes.

The models are built once per module (fixtures below); each build takes a few seconds on 2 cores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shared import models
from shared.presets import Preset, get_preset

MAX_ABS_DIFF = 1e-4
SOT, EOT, PAD = 49406, 49407, 0  # CLIP's special token ids; padding is "!" (id 0), as in SD2's tokenizer
LONG_CAPTION = " ".join(f"word{i}" for i in range(120))  # well over 77 tokens: truncated
CAPTIONS = [
    "",
    "a photo of a cat",
    LONG_CAPTION,
    "ünïcödé café, 東京の夜景 🐱🚀 — naïve",
    "  Mixed   CASE   and   spaces &amp; html  ",
    "a" * 400,
]


@pytest.fixture(scope="module")
def preset() -> Preset:
    return get_preset("tiny")


@pytest.fixture(scope="module")
def hf_encoder(preset: Preset) -> models.TransformersTextEncoder:
    encoder = models.build_text_encoder(preset, "transformers")
    assert isinstance(encoder, models.TransformersTextEncoder)
    return encoder


@pytest.fixture(scope="module")
def openclip_encoder(preset: Preset) -> models.OpenClipTextEncoder:
    encoder = models.build_text_encoder(preset, "open_clip")
    assert isinstance(encoder, models.OpenClipTextEncoder)
    return encoder


@pytest.fixture(scope="module")
def vae(preset: Preset) -> Any:
    return models.build_vae(preset)


@pytest.fixture(scope="module")
def unet(preset: Preset) -> Any:
    return models.build_unet(preset)


def openclip_ids(encoder: models.OpenClipTextEncoder, captions: list[str]) -> torch.Tensor:
    return encoder.tokenizer(captions, context_length=encoder.context_length)


# ------------------------------------------------------------------------------------- text backends
def test_both_backends_give_the_same_embeddings(
    hf_encoder: models.TransformersTextEncoder, openclip_encoder: models.OpenClipTextEncoder, preset: Preset
) -> None:
    hf = hf_encoder.encode(CAPTIONS)
    oc = openclip_encoder.encode(CAPTIONS)
    assert hf.shape == oc.shape == (len(CAPTIONS), *preset.text_shape())
    assert hf.dtype == oc.dtype == torch.float32
    diff = (hf - oc).abs().amax(dim=(1, 2))
    assert diff.max().item() < MAX_ABS_DIFF, dict(zip(CAPTIONS, diff.tolist(), strict=True))


def test_embeddings_do_not_depend_on_the_batch(hf_encoder: models.TransformersTextEncoder) -> None:
    together = hf_encoder.encode(CAPTIONS[:3])
    alone = torch.cat([hf_encoder.encode([caption]) for caption in CAPTIONS[:3]])
    assert (together - alone).abs().max().item() < MAX_ABS_DIFF


def test_tokenizers_agree_and_truncate_identically(
    hf_encoder: models.TransformersTextEncoder, openclip_encoder: models.OpenClipTextEncoder, preset: Preset
) -> None:
    hf_ids = hf_encoder.tokenize(CAPTIONS)
    oc_ids = openclip_ids(openclip_encoder, CAPTIONS)
    assert hf_ids.shape == oc_ids.shape == (len(CAPTIONS), preset.text_length)
    assert torch.equal(hf_ids.long(), oc_ids.long())

    empty, long = hf_ids[CAPTIONS.index("")], hf_ids[CAPTIONS.index(LONG_CAPTION)]
    assert empty[:2].tolist() == [SOT, EOT] and (empty[2:] == PAD).all()
    assert long[0] == SOT and long[-1] == EOT and (long != PAD).all()  # cut to 77, still ends with EOT


def test_clip_tokenizer_files_round_trip_through_save_and_load(
    tmp_path: Path, hf_encoder: models.TransformersTextEncoder
) -> None:
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(str(models.write_clip_tokenizer(tmp_path / "clip")))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (SOT, EOT, PAD)
    assert len(tokenizer) == get_preset("tiny").text["vocab_size"]
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    reloaded = CLIPTokenizer.from_pretrained(str(tmp_path / "tokenizer"))

    def ids(tok: Any) -> list[list[int]]:
        return tok(CAPTIONS, padding="max_length", max_length=77, truncation=True).input_ids

    assert ids(reloaded) == ids(tokenizer) == hf_encoder.tokenize(CAPTIONS).tolist()


# ---------------------------------------------------------------------------------------- fingerprints
def test_weights_fingerprint_is_stable_across_builds(
    preset: Preset, openclip_encoder: models.OpenClipTextEncoder, hf_encoder: models.TransformersTextEncoder
) -> None:
    again = models.build_open_clip_tower(preset)
    assert models.weights_fingerprint(again) == models.weights_fingerprint(openclip_encoder.model)
    assert openclip_encoder.fingerprint() == "open_clip:" + models.weights_fingerprint(again)
    assert hf_encoder.fingerprint().startswith("transformers:")
    assert hf_encoder.fingerprint() != openclip_encoder.fingerprint()


def test_weights_fingerprint_changes_with_one_weight(preset: Preset) -> None:
    tower = models.build_open_clip_tower(preset)
    before = models.weights_fingerprint(tower)
    with torch.no_grad():
        tower.ln_final.bias[0] += 1e-3
    assert models.weights_fingerprint(tower) != before


# ------------------------------------------------------------------------------------------- builders
def test_vae_encodes_64px_to_the_preset_latent_shape(vae: Any, preset: Preset) -> None:
    image = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        posterior = vae.encode(image).latent_dist
        decoded = vae.decode(posterior.mean).sample
    assert tuple(posterior.mean.shape[1:]) == preset.latent_shape(64) == (4, 8, 8)
    assert posterior.logvar.shape == posterior.mean.shape
    assert decoded.shape == image.shape
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())


def test_unet_forward_with_text_context(unet: Any, preset: Preset) -> None:
    latents = torch.randn(2, *preset.latent_shape(64))
    context = torch.randn(2, *preset.text_shape())
    assert tuple(context.shape) == (2, 77, 32)
    with torch.no_grad():
        out = unet(latents, torch.tensor([10, 500]), encoder_hidden_states=context).sample
    assert out.shape == latents.shape


def test_tiny_builds_are_deterministic(preset: Preset, vae: Any, unet: Any) -> None:
    assert models.weights_fingerprint(models.build_vae(preset)) == models.weights_fingerprint(vae)
    assert models.weights_fingerprint(models.build_unet(preset)) == models.weights_fingerprint(unet)


RNG_BUILDERS: dict[str, Callable[[Preset], Any]] = {
    "vae": models.build_vae,
    "unet": models.build_unet,
    "open_clip_tower": models.build_open_clip_tower,
    "open_clip_encoder": lambda p: models.build_text_encoder(p, "open_clip"),
}


@pytest.mark.parametrize("name", sorted(RNG_BUILDERS))
def test_building_leaves_the_callers_rng_alone(preset: Preset, name: str) -> None:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    RNG_BUILDERS[name](preset)
    assert torch.equal(torch.get_rng_state(), state)


def test_building_the_transformers_backend_leaves_the_callers_rng_alone(preset: Preset) -> None:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    models.build_text_encoder(preset, "transformers")
    assert torch.equal(torch.get_rng_state(), state)


# ------------------------------------------------------------------------------ OpenCLIP checkpoints
def save_openclip_style_checkpoint(tower: torch.nn.Module, path: Path) -> None:
    """What an OpenCLIP training run saves: a DDP `module.` prefix, the image tower, and bookkeeping."""
    state = {f"module.{k}": v for k, v in tower.state_dict().items()}
    state["module.visual.proj"] = torch.randn(8, 4)
    state["module.logit_scale"] = torch.tensor(4.6)
    torch.save({"epoch": 32, "name": "tiny-test", "state_dict": state}, path)


@pytest.fixture(scope="module")
def other_tower(preset: Preset) -> torch.nn.Module:
    """A tower with weights unlike the preset's default (another seed): what a checkpoint would hold."""
    return models.build_open_clip_tower(dataclasses.replace(preset, seed=preset.seed + 100))


def test_open_clip_checkpoint_loads_and_converts(
    tmp_path: Path, preset: Preset, other_tower: torch.nn.Module, openclip_encoder: models.OpenClipTextEncoder
) -> None:
    checkpoint = tmp_path / "open_clip_pytorch_model.bin"
    save_openclip_style_checkpoint(other_tower, checkpoint)

    loaded = models.build_open_clip_tower(preset, checkpoint=str(checkpoint))
    assert models.weights_fingerprint(loaded) == models.weights_fingerprint(other_tower)
    assert models.weights_fingerprint(loaded) != models.weights_fingerprint(openclip_encoder.model)

    from_checkpoint = models.build_text_encoder(preset, "open_clip", open_clip_checkpoint=str(checkpoint))
    converted = models.TransformersTextEncoder(
        models.openclip_to_transformers(loaded, preset), models.build_tokenizer(preset)
    )
    want = from_checkpoint.encode(CAPTIONS)
    diff = (converted.encode(CAPTIONS) - want).abs().max().item()
    assert diff < MAX_ABS_DIFF
    default = openclip_encoder.encode(CAPTIONS)
    assert (want - default).abs().max().item() > MAX_ABS_DIFF  # the checkpoint's weights, not the default


def test_a_checkpoint_without_the_text_tower_is_refused(tmp_path: Path, preset: Preset) -> None:
    checkpoint = tmp_path / "vision_only.bin"
    torch.save({"state_dict": {"visual.proj": torch.randn(8, 4)}}, checkpoint)
    with pytest.raises(ValueError, match="is not an OpenCLIP checkpoint for this tower; missing"):
        models.build_open_clip_tower(preset, checkpoint=str(checkpoint))


def test_open_clip_backend_with_real_weights_needs_a_checkpoint() -> None:
    with pytest.raises(ValueError, match=r"needs encoder\.open_clip_checkpoint"):
        models.build_text_encoder(get_preset("sd2-base"), "open_clip")


def test_a_pretrained_path_that_is_no_model_folder_is_one_line_and_never_the_hub(
    preset: Preset, tmp_path: Path
) -> None:
    """A typo in encoder.pretrained went to huggingface.co (five retries, ~25 s), ending in a traceback."""
    from shared.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"/models/sd2-bsae is not a folder: pass a diffusers-format folder"
    ):
        models.build_vae(preset, "/models/sd2-bsae")
    with pytest.raises(ConfigError, match=r"cannot load vae from .*empty.*and pass that folder"):
        models.build_vae(
            preset, str(tmp_path / "empty") + "/" if (tmp_path / "empty").mkdir() is None else ""
        )
