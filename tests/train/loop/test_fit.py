"""A real tiny CPU Composer run: outputs, checkpoint contents, EMA bookkeeping, data checks, phase handoff."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from composer.core import Callback

from shared.config import load_config
from shared.manifest import read_manifest
from tests.train.conftest import TinyRun, tiny_config, write_fake_dataset
from train.checkpoints.record import DatasetChangedError, ObjectiveChangedError, RunRecord
from train.config import TrainConfig
from train.data.loader import DataError
from train.ema.algorithm import find_ema, select_unet_weights
from train.loop.trainer import build_trainer, fit


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_run_writes_checkpoints_metrics_samples_and_config(tiny_run: TinyRun) -> None:
    save = tiny_run.save
    assert {p.name for p in save.glob("ep*-ba*-rank0.pt")} == {"ep0-ba6-rank0.pt", "ep1-ba12-rank0.pt"}
    assert (save / "latest-rank0.pt").resolve().name == "ep1-ba12-rank0.pt"
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all("loss" in r and "lr" in r for r in records) and records[-1]["samples"] == 12 * 8
    assert records[-1]["images_per_s"] > 0 and records[-1]["images_per_s_per_device"] > 0
    assert list((save / "tensorboard").rglob("events.out.tfevents.*"))
    assert sorted(p.name for p in (save / "samples").glob("*.png")) == ["ba00000006.png", "ba00000012.png"]
    assert list((save / "logs").glob("train-*-rank0.log"))
    reloaded = load_config(TrainConfig, yaml.safe_load((save / "train_config.yaml").read_text()))
    assert reloaded.data.version == "v1" and reloaded.run_name == tiny_run.cfg.resolved_run_name()
    pinned = dataclasses.replace(tiny_run.cfg.data, version="v1")
    assert reloaded == dataclasses.replace(tiny_run.cfg, run_name=reloaded.run_name, data=pinned)


def test_checkpoint_records_dataset_model_and_encoders(tiny_run: TinyRun) -> None:
    record = tiny_run.checkpoint_state()["callbacks"]["RunRecord"]
    manifest = read_manifest(tiny_run.cfg.data.uri)
    assert record["dataset"]["fingerprint"] == manifest.dataset_fingerprint
    assert record["dataset"]["version"] == manifest.version == "v1"
    assert record["dataset"]["resolution"] == 64
    assert record["encoders"] == manifest.fingerprints["encoders"]
    assert record["encoder_config"] == manifest.config["encoder"]
    assert record["preset"] == "tiny" and record["model"]["prediction_type"] == "v_prediction"
    assert record["scale_factor"] == manifest.scale_factor


def test_checkpoint_holds_ema_in_model_and_training_weights_in_ema_state(tiny_run: TinyRun) -> None:
    state = tiny_run.checkpoint_state()
    ema_state = dict(state["algorithms"])["HandoffEMA"]
    assert ema_state["ema_started"] and ema_state["ema_weights_active"]
    ema_weights, what = select_unet_weights(state, "ema")
    training, _ = select_unet_weights(state, "training")
    assert what == "ema"
    assert max_abs_diff(ema_weights, training) > 1e-4  # smoothing 0.9 over 12 steps: clearly apart
    # The finished trainer still has the last checkpoint's swap: model = EMA, EMA storage = training weights.
    trainer = tiny_run.trainer
    live = {k: v for k, v in trainer.state.model.unet.state_dict().items()}
    assert max_abs_diff(ema_weights, live) == 0.0
    stored = find_ema(trainer.state.algorithms).ema_model.named_parameters_dict
    assert max_abs_diff(training, {k.removeprefix("unet."): v for k, v in stored.items()}) == 0.0


def copy_run(run: TinyRun, dest: Path) -> Path:
    shutil.copytree(run.save, dest, symlinks=True)
    return dest


def test_resume_on_other_dataset_is_refused(tiny_run: TinyRun, tmp_path: Path) -> None:
    other = tmp_path / "other"
    write_fake_dataset(other, n=64, salt="changed")
    save = copy_run(tiny_run, tmp_path / "save")
    cfg = tiny_config(str(other), save, tmp_path / "cache", "max_duration=13ba", "samples.enabled=false")
    with pytest.raises(DatasetChangedError, match=r"data\.version=v1.*allow_dataset_change"):
        build_trainer(cfg)


def test_resume_with_another_epoch_size_is_refused(tiny_run: TinyRun, tmp_path: Path) -> None:
    """data.epoch_size reorders the samples of one dataset too: the saved position would land elsewhere."""
    save = copy_run(tiny_run, tmp_path / "save")
    cfg = tiny_config(
        tiny_run.cfg.data.uri, save, tmp_path / "cache", "max_duration=13ba", "samples.enabled=false",
        "data.epoch_size=40",
    )  # fmt: skip
    with pytest.raises(
        DatasetChangedError, match=r"epoch_size None\) but .*epoch_size 40\).*data\.epoch_size"
    ):
        build_trainer(cfg)


def test_resume_with_another_objective_is_refused_and_a_weights_only_phase_is_not(
    tiny_run: TinyRun, tmp_path: Path
) -> None:
    """The optimizer moments and EMA belong to the old target, and export would describe the new one."""
    assert tiny_run.cfg.model.prediction_type == "v_prediction" and tiny_run.cfg.model.zero_terminal_snr
    flipped = "epsilon"
    save = copy_run(tiny_run, tmp_path / "save")
    common = (tiny_run.cfg.data.uri, "max_duration=13ba", "samples.enabled=false")
    changed = (f"model.prediction_type={flipped}", "model.zero_terminal_snr=false")
    cfg = tiny_config(common[0], save, tmp_path / "cache", *common[1:], *changed)
    with pytest.raises(
        ObjectiveChangedError,
        match=rf"prediction_type=v_prediction, zero_terminal_snr=True but this run asks for prediction_type="
        rf"{flipped}, zero_terminal_snr=False.*"
        r"load_weights_only=true",
    ):
        build_trainer(cfg)
    phase = tiny_config(
        common[0], tmp_path / "phase", tmp_path / "cache-2", "max_duration=1ba", "samples.enabled=false",
        *changed, f"load_path={save}", "load_weights_only=true",
    )  # fmt: skip
    assert int(fit(phase).state.timestamp.batch) == 1


def test_a_resume_streams_the_version_it_trained_on_after_a_re_encode(tmp_path: Path) -> None:
    """A re-encode published while the run was stopped (a requeue, a restart): every restart pinned the new
    current version and was refused (docs/reliability.md promises a re-encode changes nothing for a job)."""
    data, save = tmp_path / "data", tmp_path / "save"
    write_fake_dataset(data, n=64, version="v1")
    common = ("samples.enabled=false", "save_interval=1ba")
    fit(tiny_config(str(data), save, tmp_path / "cache", "max_duration=2ba", *common))
    write_fake_dataset(data, n=64, version="v2", salt="re-encoded")  # now the current version
    resumed = fit(tiny_config(str(data), save, tmp_path / "cache-2", "max_duration=3ba", *common))
    assert int(resumed.state.timestamp.batch) == 3
    assert "version: v1" in (save / "train_config.yaml").read_text()
    shutil.rmtree(data / "versions" / "v1")  # `encode gc` while the run was stopped
    with pytest.raises(DataError, match=r"trained on is gone .*data\.allow_dataset_change=true"):
        build_trainer(tiny_config(str(data), save, tmp_path / "cache-3", "max_duration=4ba", *common))


def test_allow_dataset_change_resumes_anyway(tiny_run: TinyRun, tmp_path: Path) -> None:
    other = tmp_path / "other"
    write_fake_dataset(other, n=64, salt="changed")
    save = copy_run(tiny_run, tmp_path / "save")
    cfg = tiny_config(
        str(other), save, tmp_path / "cache", "max_duration=13ba", "samples.enabled=false",
        "data.allow_dataset_change=true",
    )  # fmt: skip
    trainer = fit(cfg)
    assert int(trainer.state.timestamp.batch) == 13


class SnapshotAtFitStart(Callback):
    """Records model and EMA weights right after Composer's FIT_START handlers (algorithms run first)."""

    def __init__(self) -> None:
        self.model: dict[str, torch.Tensor] = {}
        self.ema: dict[str, torch.Tensor] = {}

    def fit_start(self, state: Any, logger: Any) -> None:
        self.model = {k: v.clone() for k, v in state.model.unet.state_dict().items()}
        ema = find_ema(state.algorithms).ema_model.named_parameters_dict
        self.ema = {k.removeprefix("unet."): v.clone() for k, v in ema.items()}


def test_phase_handoff_starts_model_and_ema_from_phase1_ema(tiny_run: TinyRun, tmp_path: Path) -> None:
    write_fake_dataset(tmp_path / "data512", resolution=128, n=16, partitions=1)
    cfg = tiny_config(
        str(tmp_path / "data512"), tmp_path / "phase2", tmp_path / "cache",
        "data.resolution=128", f"load_path={tiny_run.save}", "load_weights_only=true",
        "max_duration=2ba", "samples.enabled=false", "ema.start=1000ba",
    )  # fmt: skip
    trainer = build_trainer(cfg)
    phase1_ema, _ = select_unet_weights(tiny_run.checkpoint_state(), "ema")
    snapshot = SnapshotAtFitStart()
    trainer.state.callbacks.append(snapshot)  # type: ignore[arg-type]
    trainer.fit()
    trainer.close()
    assert max_abs_diff(snapshot.model, phase1_ema) == 0.0
    assert max_abs_diff(snapshot.ema, phase1_ema) == 0.0  # seeded although ema.start is far away
    assert int(trainer.state.timestamp.batch) == 2  # fresh timestamp, optimizer and schedule
    record = next(cb for cb in trainer.state.callbacks if isinstance(cb, RunRecord))
    assert record.record["dataset"]["resolution"] == 128
