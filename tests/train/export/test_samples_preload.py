"""Issue 22 (4): the sample renderer loads its text tower, tokenizer and VAE when the trainer is built, never
at a render (step 5000 of the recipe, while the other ranks wait in a collective), and local rank 0 loads
before the node's other ranks, which then read its copy."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest

from shared.encoders import EncoderIdentity
from tests.train.conftest import tiny_config
from train.export import samples
from train.export.samples import SampleRenderer, local_rank_zero_first
from train.loop.trainer import build_trainer


def test_renderer_loads_at_build_and_never_during_training(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[tuple[str, str]] = []
    phase = ["build"]
    real_text, real_vae = EncoderIdentity.build_text_encoder, samples.build_vae

    def text(self: EncoderIdentity, *args: Any) -> Any:
        loads.append(("text", phase[0]))
        return real_text(self, *args)

    def vae(*args: Any) -> Any:
        loads.append(("vae", phase[0]))
        return real_vae(*args)

    monkeypatch.setattr(EncoderIdentity, "build_text_encoder", text)
    monkeypatch.setattr(samples, "build_vae", vae)
    cfg = tiny_config(
        tiny_dataset, tmp_path / "save", tmp_path / "cache", "max_duration=2ba", "save_interval=2ba",
        "samples.interval=1ba", "samples.steps=2", "samples.prompts=[a cat]", "samples.images_per_prompt=1",
    )  # fmt: skip
    trainer = build_trainer(cfg)
    renderer = next(cb for cb in trainer.state.callbacks if isinstance(cb, SampleRenderer))
    assert renderer.prompt_embeddings is not None and renderer.vae is not None
    phase[0] = "fit"
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert loads == [("text", "build"), ("vae", "build")]  # once each, before the first step
    assert sorted(p.name for p in (tmp_path / "save" / "samples").glob("*.png")) == [
        "ba00000001.png", "ba00000002.png",
    ]  # fmt: skip
    # the loaded marker went at close: every launch left one in the samples folder (and mirrored to S3)
    assert not list((tmp_path / "save" / "samples").glob(".loaded-*"))


def _load_as(local_rank: int, marker_dir: str, log: str) -> None:
    os.environ["LOCAL_RANK"] = str(local_rank)
    with local_rank_zero_first(marker_dir, timeout_s=60):
        if local_rank == 0:
            time.sleep(1.0)  # a slow download: rank 1 must not start meanwhile
        with open(log, "a") as f:
            f.write(f"{local_rank} ")


def test_local_rank_zero_loads_first_and_the_others_wait_without_a_collective(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = str(tmp_path / "order.txt")
    context = multiprocessing.get_context("fork")  # both share this process as the parent (the launcher)
    ranks = [context.Process(target=_load_as, args=(rank, str(tmp_path), log)) for rank in (1, 0)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
    assert [p.exitcode for p in ranks] == [0, 0]
    assert Path(log).read_text().split() == ["0", "1"]
    # a later launch (another parent pid) does not take this launch's marker for its own
    monkeypatch.setenv("LOCAL_RANK", "1")
    with (
        pytest.raises(TimeoutError, match="local rank 0 did not finish"),
        local_rank_zero_first(str(tmp_path / "elsewhere"), timeout_s=0.5),
    ):
        pass
