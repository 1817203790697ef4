"""Export: a diffusers folder that StableDiffusionPipeline loads offline: EMA U-Net + encode's encoders."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from shared.manifest import read_manifest
from shared.models import build_text_encoder, weights_fingerprint
from shared.presets import get_preset
from tests.train.conftest import TinyRun
from train.checkpoints.files import read_checkpoint
from train.cli import app
from train.ema.algorithm import select_unet_weights
from train.export.pipeline import ExportError, export_pipeline


@pytest.fixture(scope="module")
def exported(tiny_run: TinyRun, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "pipeline"
    result = CliRunner().invoke(app, ["export", str(tiny_run.save), str(out)])
    assert result.exit_code == 0, result.output
    assert "exported ema weights" in result.output
    return out


def load_pipeline(path: Path) -> object:
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(
        str(path), safety_checker=None, requires_safety_checker=False, local_files_only=True
    )


def test_exported_unet_holds_the_ema_weights(tiny_run: TinyRun, exported: Path) -> None:
    pipe = load_pipeline(exported)
    state = tiny_run.checkpoint_state()
    ema, _ = select_unet_weights(state, "ema")
    training, _ = select_unet_weights(state, "training")
    got = pipe.unet.state_dict()
    assert all(torch.equal(got[k], ema[k]) for k in ema)
    assert any(not torch.equal(got[k], training[k]) for k in training)


def test_exported_encoders_and_scheduler_match_the_dataset(tiny_run: TinyRun, exported: Path) -> None:
    pipe = load_pipeline(exported)
    manifest = read_manifest(tiny_run.cfg.data.uri)
    assert weights_fingerprint(pipe.vae) == manifest.fingerprints["encoders"]["vae"]
    text = build_text_encoder(get_preset("tiny"), "transformers")
    assert weights_fingerprint(pipe.text_encoder) == weights_fingerprint(text.model)
    assert pipe.vae.config.scaling_factor == manifest.scale_factor
    assert type(pipe.scheduler).__name__ == "DDIMScheduler"
    model_cfg = tiny_run.cfg.model  # tiny.yaml: v-prediction with zero terminal SNR
    assert pipe.scheduler.config.prediction_type == model_cfg.prediction_type == "v_prediction"
    assert pipe.scheduler.config.rescale_betas_zero_snr is model_cfg.zero_terminal_snr is True
    assert pipe.scheduler.config.timestep_spacing == "trailing"
    assert (pipe.scheduler.config.beta_start, pipe.scheduler.config.beta_end) == (0.00085, 0.012)
    assert pipe.unet.config.sample_size == 8  # 64 px / the tiny VAE's 8x downsampling


def test_exported_pipeline_generates(exported: Path) -> None:
    pipe = load_pipeline(exported)
    out = pipe(
        "a red circle", num_inference_steps=2, height=64, width=64, output_type="np",
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert out.images.shape == (1, 64, 64, 3)
    assert torch.isfinite(torch.from_numpy(out.images)).all()


def test_export_refuses_a_different_vae(tiny_run: TinyRun, tmp_path: Path) -> None:
    ckpt = read_checkpoint(tiny_run.save / "latest-rank0.pt")
    record = ckpt["state"]["callbacks"]["RunRecord"]
    record.pop("encoder")  # a checkpoint from before the typed EncoderIdentity: its older keys are read
    record["encoders"]["vae"] = "0" * 64
    tampered = tmp_path / "tampered.pt"
    torch.save(ckpt, tampered)
    with pytest.raises(ExportError, match="allow-encoder-mismatch"):
        export_pipeline(str(tampered), str(tmp_path / "out"))
    result = export_pipeline(
        str(tampered), str(tmp_path / "out"), sampler="euler", allow_encoder_mismatch=True
    )
    assert result.weights == "ema"
    assert (
        (tmp_path / "out" / "scheduler" / "scheduler_config.json").read_text().count("EulerDiscreteScheduler")
    )


def test_export_of_a_folder_without_checkpoints_names_the_fix(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["export", str(tmp_path), str(tmp_path / "out")])
    assert result.exit_code == 2 and "save folder" in result.output


@pytest.mark.parametrize(
    "content",
    [b"hello\n", bytes(range(256)) * 3, {"a": 1}, torch.zeros(3)],
    ids=["text", "random-bytes", "other-dict", "tensor"],
)
def test_export_of_a_file_that_is_no_checkpoint_is_one_line(tmp_path: Path, content: object) -> None:
    """Each was a KeyError / IndexError traceback (torch's legacy reader, or no "state" in it)."""
    path = tmp_path / "ep0-ba1-rank0.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    result = CliRunner().invoke(app, ["export", str(path), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "not a checkpoint" in result.output and "Traceback" not in result.output


def test_a_square_export_into_a_bucketed_export_folder_leaves_no_buckets_json(
    exported: Path, tiny_run: TinyRun, tmp_path: Path
) -> None:
    """An earlier export's buckets.json claimed buckets the new model never trained on."""
    import shutil

    out = tmp_path / "pipeline"
    shutil.copytree(exported, out)
    (out / "buckets.json").write_text('{"resolution": 64, "buckets": {"48x80": 10}}\n')
    result = CliRunner().invoke(app, ["export", str(tiny_run.save), str(out)])
    assert result.exit_code == 0, result.output
    assert not (out / "buckets.json").exists()


def test_init_from_an_exported_folder_loads_its_unet(exported: Path, tiny_run: TinyRun) -> None:
    from train.loop.trainer import build_unet

    cfg = dataclasses.replace(
        tiny_run.cfg, model=dataclasses.replace(tiny_run.cfg.model, init_from=str(exported))
    )
    ema, _ = select_unet_weights(tiny_run.checkpoint_state(), "ema")
    got = build_unet(cfg).state_dict()
    assert all(torch.equal(got[k], ema[k]) for k in ema)
