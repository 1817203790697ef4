"""No host-device syncs in the training step (issue 11.5): the loader brings one seed per sample, the step
draws from the seeds on the device and never reads a tensor back, and the loss is read back only every
log.console_interval and before saves.

On CPU nothing really syncs, so these tests count the calls that would sync on a GPU (`.item()`,
`.tolist()`, `.cpu()`, `bool(t)`, ...; train/bench/trainer/syncs.py); tests/train/test_gpu.py checks the
same on a GPU with torch.cuda.set_sync_debug_mode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.contract import LATENT_MEAN
from shared.presets import get_preset
from shared.runtime.device import resolve_device_setup
from tests.train.conftest import tiny_config
from train.bench.step import synthetic_latent_batch, train_step
from train.bench.trainer.syncs import count_readbacks, step_tracker
from train.config import DataConfig
from train.data.draws import MissingDrawsError, draw_for_samples
from train.data.loader import SAMPLE_SEED, build_dataset, pin_version, read_dataset_manifest
from train.loop.trainer import build_optimizer, build_trainer
from train.model.assemble import assemble_model

STEPS = 7
LOG_EVERY = 3
SAVE_AT = 5


def test_the_objective_draws_from_the_seeds_the_loader_rows_carry(tiny_dataset: str, tmp_path: Path) -> None:
    """The noise the step trains on is the draw of each row's seed, whatever batch the row lands in."""
    cfg = DataConfig(uri=tiny_dataset, resolution=64, cache_dir=str(tmp_path), num_workers=0, shuffle=False)
    pinned = pin_version(cfg, read_dataset_manifest(cfg))
    rows = list(build_dataset(cfg, pinned, per_rank_batch=4, seed=3))[:3]
    model = assemble_model(tiny_config("unused", "unused", "unused"), "cpu", 1.0, torch.zeros(77, 32))

    def batch_of(some: list[dict]) -> dict[str, torch.Tensor]:
        return {name: torch.stack([torch.as_tensor(r[name]) for r in some]) for name in some[0]}

    inputs = model.objective.prepare(batch_of(rows))
    for i, row in enumerate(rows):
        alone = model.objective.prepare(batch_of([row]))
        assert torch.equal(inputs.noisy[i], alone.noisy[0]) and torch.equal(inputs.target[i], alone.target[0])
        draws = draw_for_samples(torch.tensor([row[SAMPLE_SEED]]), tuple(row[LATENT_MEAN].shape), 1000)
        assert int(inputs.timesteps[i]) == int(draws.timesteps[0])


def test_objective_refuses_a_batch_without_seeds() -> None:
    cfg = tiny_config("unused", "unused", "unused")
    model = assemble_model(cfg, "cpu", 1.0, torch.zeros(get_preset("tiny").text_shape()))
    batch = synthetic_latent_batch(get_preset("tiny"), 64, 2, resolve_device_setup("cpu", "fp32", False), 0)
    batch.pop(SAMPLE_SEED)
    with pytest.raises(MissingDrawsError, match="seed"):
        model(batch)


def test_the_step_reads_nothing_back() -> None:
    """Forward (objective + U-Net), loss, backward and optimizer step: not one read-back."""
    cfg = tiny_config("unused", "unused", "unused")
    setup = resolve_device_setup("cpu", "fp32", False)
    model = assemble_model(cfg, "cpu", 1.0, torch.zeros(get_preset("tiny").text_shape()))
    optimizer = build_optimizer(cfg, model)
    batch = synthetic_latent_batch(get_preset("tiny"), 64, 2, setup, 0)
    train_step(model, optimizer, batch, setup)  # lazy state (optimizer moments) outside the count
    with count_readbacks() as counts:
        train_step(model, optimizer, batch, setup)
    assert counts.by_step == {}


def run_counted(tiny_dataset: str, tmp_path: Path, *extra: str) -> tuple[Any, Any]:
    cfg = tiny_config(
        tiny_dataset, tmp_path / "save", tmp_path / "cache",
        f"max_duration={STEPS}ba", f"log.console_interval={LOG_EVERY}ba", f"save_interval={SAVE_AT}ba",
        "samples.enabled=false", *extra,
    )  # fmt: skip
    trainer = build_trainer(cfg)
    with count_readbacks() as counts:
        trainer.state.callbacks.insert(0, step_tracker(counts))
        try:
            trainer.fit()
        finally:
            trainer.close()
    return cfg, counts


def test_trainer_reads_back_only_at_log_and_checkpoint_steps(tiny_dataset: str, tmp_path: Path) -> None:
    cfg, counts = run_counted(tiny_dataset, tmp_path)
    flush_steps = {LOG_EVERY, 2 * LOG_EVERY, SAVE_AT, STEPS}
    assert set(counts.steps_with("train/")) <= flush_steps
    assert set(counts.steps_with("train/loop/step.py")) == flush_steps  # one loss read per flush
    for step in sorted(set(range(1, STEPS + 1)) - flush_steps):
        # Neither the train job nor Composer's loop (LeanTrainer) reads anything back between flushes.
        assert counts.at(step) == {}, step
    lines = [json.loads(line) for line in (Path(cfg.save_folder) / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert all(isinstance(line["loss"], float) and line["loss"] > 0 for line in lines)


@pytest.mark.parametrize("debug", ["", "1"])
def test_engine_debug_lines_cost_nothing_unless_asked_for(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, debug: str
) -> None:
    from train.loop.events import ENGINE_DEBUG, LeanEngine

    monkeypatch.setenv(ENGINE_DEBUG, debug)
    # Grouped, both cases run in one process and pytest hands the second the first's (removed) tmp_path;
    # each case has its own cache folder, as the first trainer's dataset may not be collected yet.
    cache = tmp_path / f"cache-{debug or 'off'}"
    cfg = tiny_config(tiny_dataset, tmp_path / "save", cache, "samples.enabled=false")
    trainer = build_trainer(cfg)
    try:
        lean = type(trainer.engine) is LeanEngine
        assert lean == (not debug)  # ENGINE_DEBUG set: Composer's own dispatch and per-callback debug lines
    finally:
        trainer.close()
