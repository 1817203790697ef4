"""The model switches (issue 11.6, 11.7): `compile` compiles the U-Net alone, `channels_last` is a train
config switch, and `make bench` builds its model through the train job's code from the same TrainConfig."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.transformers.transformer_2d import Transformer2DModel

from shared.runtime.device import DeviceSetup
from tests.train.conftest import tiny_config
from train.bench.step import StepBench
from train.loop.prepare import prepare_run
from train.loop.trainer import build_model, build_trainer
from train.model.assemble import assemble_model, use_channels_last


def conv_weight(model: torch.nn.Module) -> torch.Tensor:
    return model.unet.conv_in.weight


def test_compile_compiles_the_unet_only_and_keeps_names(tiny_dataset: str, tmp_path: Path) -> None:
    """Not the whole forward (Python per-sample code included): the U-Net, in place, names unchanged."""
    cfg = tiny_config(tiny_dataset, tmp_path / "save", tmp_path / "cache", "compile=true")
    model = build_model(prepare_run(cfg))
    assert model.unet._compiled_call_impl is not None
    assert model._compiled_call_impl is None and model.objective is not None
    plain = build_model(prepare_run(tiny_config(tiny_dataset, tmp_path / "s2", tmp_path / "cache")))
    assert list(model.state_dict()) == list(plain.state_dict())
    assert not any("_orig_mod" in name for name in model.state_dict())


def test_trainer_leaves_compilation_to_the_model(tiny_dataset: str, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path / "save", tmp_path / "cache", "compile=true", "max_duration=1ba")
    trainer = build_trainer(cfg)
    try:
        model = trainer.state.model
        assert type(model.forward).__name__ == "method"  # Composer did not wrap the forward in dynamo
        assert model.unet._compiled_call_impl is not None
    finally:
        trainer.close()


def test_fsdp_null_trains_one_rank_unwrapped_and_shards_several(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The SD2 recipes' fsdp: null on one rank: no FSDP wrapper and NHWC conv kernels (FSDP keeps them
    NCHW), as fsdp=false; the run's resolved config says so. On several ranks the same config shards. And a
    null device_microbatch_size on CPU (no GPU memory to fit) is the rank's batch: no accumulation."""
    from train.loop import prepare
    from train.loop.trainer import parallelism_config

    cfg = tiny_config(tiny_dataset, tmp_path / "save", tmp_path / "cache", "fsdp=null", "device=cpu",
                      "channels_last=true", "max_duration=1ba", "device_microbatch_size=null")  # fmt: skip
    with caplog.at_level("INFO", logger="train.loop.prepare"):
        trainer = build_trainer(cfg)
    try:
        assert "fsdp: null -> false on 1 rank (one rank has nothing to shard)" in caplog.text
        batch = cfg.global_batch_size
        said = f"device_microbatch_size: null -> {batch} (no GPU memory to fit: the rank's batch)"
        assert said in caplog.text
        assert trainer.state.device_train_microbatch_size == batch
        assert trainer.state.fsdp_config is None and not trainer.state.fsdp_enabled
        kernels = [p for p in trainer.state.model.unet.parameters() if p.dim() == 4]
        assert all(p.is_contiguous(memory_format=torch.channels_last) for p in kernels)
    finally:
        trainer.close()
    (resolved,) = tmp_path.glob("**/train_config.yaml")  # the run's config as it ran (train/loop/trainer.py)
    assert "\nfsdp: false\n" in resolved.read_text()
    assert f"\ndevice_microbatch_size: {cfg.global_batch_size}\n" in resolved.read_text()
    monkeypatch.setattr(prepare, "world_size", lambda: 2)  # what prepare_run decides for two ranks
    two = prepare.prepare_run(cfg)
    assert two.cfg.fsdp is True and parallelism_config(two)["fsdp"]["state_dict_type"] == "sharded"  # type: ignore[index]


def test_channels_last_is_on_for_gpu_by_default_and_anywhere_when_asked(
    tiny_dataset: str, tmp_path: Path
) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path / "save", tmp_path / "cache")
    assert cfg.channels_last is None and use_channels_last(cfg, "gpu") and not use_channels_last(cfg, "cpu")
    off = tiny_config(tiny_dataset, tmp_path / "save", tmp_path / "cache", "channels_last=false")
    assert not use_channels_last(off, "gpu")
    on = tiny_config(tiny_dataset, tmp_path / "save", tmp_path / "cache", "channels_last=true")
    assert use_channels_last(on, "cpu")  # the GPU layout on CPU ranks, for the tests (issue 22)
    empty = torch.zeros(77, 32)
    on_gpu = assemble_model(cfg, "gpu", 1.0, empty)  # built on the host: the layout is set before .to()
    assert conv_weight(on_gpu).is_contiguous(memory_format=torch.channels_last)
    assert on_gpu.memory_format == torch.channels_last
    assert conv_weight(assemble_model(cfg, "cpu", 1.0, empty)).is_contiguous()
    assert assemble_model(on, "cpu", 1.0, empty).memory_format == torch.channels_last


def test_fsdp_keeps_weights_nchw_and_feeds_nhwc_inputs(tiny_dataset: str, tmp_path: Path) -> None:
    """FSDP flattens parameters in memory order and torch 2.7 reads optimizer state back row-major: under
    FSDP the weights stay NCHW, the inputs go NHWC (train/model/assemble.py)."""
    switches = ("fsdp=true", "channels_last=true")
    sharded = tiny_config(tiny_dataset, tmp_path / "save", tmp_path / "cache", *switches)
    for device in ("gpu", "cpu"):
        model = assemble_model(sharded, device, 1.0, torch.zeros(77, 32))
        assert model.memory_format == torch.channels_last
        kernels = [p for p in model.unet.parameters() if p.dim() == 4]
        assert kernels and all(p.is_contiguous() for p in kernels)


def test_bench_builds_the_trainer_model(tiny_dataset: str, tmp_path: Path) -> None:
    """Same class, layout and U-Net config from one TrainConfig (the GPU layout checked on host tensors)."""
    cfg = tiny_config(tiny_dataset, tmp_path / "save", tmp_path / "cache")
    trained = assemble_model(cfg, "gpu", 1.0, torch.zeros(77, 32))
    as_gpu = DeviceSetup(torch.device("cpu"), "gpu", "host standing in for a GPU", "fp32", True)
    benched = StepBench(cfg, as_gpu, online=False).model
    assert type(benched) is type(trained) and type(benched.unet) is type(trained.unet)
    assert dict(benched.unet.config) == dict(trained.unet.config)
    assert benched.memory_format == trained.memory_format == torch.channels_last
    assert conv_weight(benched).is_contiguous(memory_format=torch.channels_last)
    assert list(benched.state_dict()) == list(trained.state_dict())


def test_fsdp_units_are_the_unets_blocks_where_composer_looks_for_them(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Composer 0.32 looks the auto-wrap rule up on each child of the ComposerModel (the U-Net): one FSDP
    unit per ResNet / transformer block, so gathering a block's weights overlaps the previous block's
    compute, instead of the whole U-Net as one unit gathered before any compute."""
    cfg = tiny_config(tiny_dataset, tmp_path / "save", tmp_path / "cache")
    model = assemble_model(cfg, "cpu", 1.0, torch.zeros(77, 32))
    rule = model.unet.fsdp_wrap_fn
    units = [m for m in model.unet.modules() if rule(m)]
    assert units and all(isinstance(m, (ResnetBlock2D, Transformer2DModel)) for m in units)
    assert len(units) == sum(isinstance(m, (ResnetBlock2D, Transformer2DModel)) for m in model.unet.modules())
    assert not rule(model.unet)
