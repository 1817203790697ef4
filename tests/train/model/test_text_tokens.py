"""text.store=tokens through train: same loss as stored embeddings, the tower outside every trained state,
resume and export, and a refused weights-hash mismatch.

One encode output holds both modes as two versions of the same data (the second reuses the first's
latents): `data.version` picks which one a run trains on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from encode.config import EncodeConfig
from encode.pipeline import RankInfo, run_rank
from encode.process.encoders import load_encoders
from encode.publish.finalize import publish
from encode.sample_data import build_webdataset
from shared.config import load_config
from shared.contract import LATENT_MEAN
from shared.encoders import EncoderMismatchError
from shared.manifest import read_manifest
from shared.models import build_open_clip_tower, build_tokenizer, openclip_to_transformers
from shared.presets import get_preset
from tests.train.conftest import single_threaded_torch, tiny_config
from train.data.draws import SAMPLE_SEED, draw_for_samples
from train.data.loader import build_dataloader
from train.data.packing import unpack
from train.loop.prepare import prepare_run
from train.loop.trainer import build_model, fit
from train.model.online_text import online_text_for

RES = 64
DROPOUT = 0.5  # so a batch of 8 holds both dropped and kept captions


@dataclass(frozen=True)
class TwoModes:
    root: str
    embeddings: str  # version ids
    tokens: str
    source: str  # the webdataset both were encoded from


@pytest.fixture(scope="module")
def two_modes(tmp_path_factory: pytest.TempPathFactory) -> TwoModes:
    base = tmp_path_factory.mktemp("two-modes")
    build_webdataset(base / "wds", shards=2, per_shard=16, seed=11)
    root = base / "encoded"

    def cfg(*extra: str) -> EncodeConfig:
        return encode_cfg(base / "wds", root, *extra)

    with single_threaded_torch():
        encoders = load_encoders(cfg())
        versions = []
        for extra in ((), ("text.store=tokens",)):
            run_rank(cfg(*extra), RankInfo(0, 1), encoders)
            versions.append(publish(cfg(*extra), encoders).manifest.version)
    return TwoModes(str(root), *versions, str(base / "wds"))


def encode_cfg(source: str | Path, output: str | Path, *extra: str) -> EncodeConfig:
    overrides = [f"source.uri={source}", f"output.uri={output}", "workers=0", "progress=false"]
    sizes = ["filter.min_size=64", f"transform.resolutions=[{RES}]"]
    return load_config(EncodeConfig, "sample", [*overrides, *sizes, *extra], kind="datasets")


def first_batch_outputs(
    two_modes: TwoModes, version: str, tmp: Path
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(text the U-Net sees, loss) of the first batch of a fresh run on one version, fp32 on CPU."""
    cfg = tiny_config(
        two_modes.root, tmp / "save", tmp / "cache", f"data.version={version}",
        f"model.caption_dropout={DROPOUT}", "device=cpu",
    )  # fmt: skip
    ctx = prepare_run(cfg)
    model = build_model(ctx)
    loader = build_dataloader(cfg.data, ctx.pinned, ctx.batching.per_rank_batch, cfg.seed)
    batch = unpack(next(iter(loader)))
    with torch.no_grad():
        text = model.objective.condition(batch, coins(batch))
        loss = model.loss(model(batch), batch)
    return text, loss, batch


def coins(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The caption-dropout coins the objective draws for this batch's samples."""
    return draw_for_samples(batch[SAMPLE_SEED], tuple(batch[LATENT_MEAN].shape[1:]), 1000).coin


def test_one_step_gives_the_same_loss_in_both_modes(two_modes: TwoModes, tmp_path: Path) -> None:
    text_e, loss_e, batch_e = first_batch_outputs(two_modes, two_modes.embeddings, tmp_path / "e")
    text_t, loss_t, batch_t = first_batch_outputs(two_modes, two_modes.tokens, tmp_path / "t")
    assert "text_tokens" in batch_t and "text_embedding" not in batch_t
    dropped = coins(batch_e) < DROPOUT
    assert dropped.any() and not dropped.all(), "the batch must hold dropped and kept captions"
    assert torch.equal(batch_e[SAMPLE_SEED], batch_t[SAMPLE_SEED])
    assert torch.equal(text_e, text_t)  # dropped ones too: the same empty-caption embedding
    assert loss_e.item() == loss_t.item()


def test_tokens_run_trains_resumes_and_exports_without_saving_the_tower(
    two_modes: TwoModes, tmp_path: Path
) -> None:
    from diffusers import StableDiffusionPipeline

    from train.export.pipeline import export_pipeline

    extra = (f"data.version={two_modes.tokens}", "save_interval=2ba", "samples.interval=2ba", "device=cpu")
    with single_threaded_torch():
        first = fit(
            tiny_config(two_modes.root, tmp_path / "save", tmp_path / "cache", "max_duration=2ba", *extra)
        )
        model = first.state.model
        tower = model.objective.online_text.parameters
        assert tower and not {id(p) for p in tower} & {id(p) for p in model.parameters()}
        optimized = {id(p) for group in first.state.optimizers[0].param_groups for p in group["params"]}
        assert optimized == {id(p) for p in model.unet.parameters()}
        resumed = fit(
            tiny_config(two_modes.root, tmp_path / "save", tmp_path / "cache", "max_duration=4ba", *extra)
        )
    assert int(resumed.state.timestamp.batch) == 4
    state = torch.load(tmp_path / "save" / "latest-rank0.pt", map_location="cpu", weights_only=False)["state"]
    assert all(key.startswith("unet.") for key in state["model"]), "only the U-Net is checkpointed"
    assert state["callbacks"]["RunRecord"]["encoder"]["text_store"] == "tokens"
    assert sorted((tmp_path / "save" / "samples").glob("ba*.png")), "sample grids render in tokens mode"
    export_pipeline(str(tmp_path / "save"), str(tmp_path / "pipe"))
    pipe = StableDiffusionPipeline.from_pretrained(str(tmp_path / "pipe"))
    assert pipe.text_encoder.config.num_hidden_layers == get_preset("tiny").text["layers"] - 1


def test_a_text_encoder_with_other_weights_is_refused(two_modes: TwoModes, tmp_path: Path) -> None:
    preset = get_preset("tiny")
    other = openclip_to_transformers(
        build_open_clip_tower(preset.__class__(**{**vars(preset), "seed": 99})), preset
    )
    other.save_pretrained(tmp_path / "other" / "text_encoder")
    build_tokenizer(preset).save_pretrained(tmp_path / "other" / "tokenizer")
    manifest = read_manifest(two_modes.root, two_modes.tokens)
    with pytest.raises(EncoderMismatchError) as err:
        online_text_for(manifest, str(tmp_path / "other"))
    assert manifest.identity.text_hash in str(err.value) and "model.text_encoder" in str(err.value)
    assert online_text_for(read_manifest(two_modes.root, two_modes.embeddings), None) is None


@pytest.mark.s3
def test_tokens_dataset_on_s3_encodes_and_trains(two_modes: TwoModes, s3_prefix: str, tmp_path: Path) -> None:
    data = f"{s3_prefix}/tokens"
    cfg = encode_cfg(two_modes.source, data, "text.store=tokens")
    with single_threaded_torch():
        encoders = load_encoders(cfg)
        run_rank(cfg, RankInfo(0, 1), encoders)
        manifest = publish(cfg, encoders).manifest
        assert manifest.text_store == "tokens"
        run = fit(tiny_config(data, tmp_path / "save", tmp_path / "cache", "max_duration=2ba", "device=cpu",
                              "samples.enabled=false"))  # fmt: skip
    assert int(run.state.timestamp.batch) == 2 and run.state.model.objective.online_text is not None
