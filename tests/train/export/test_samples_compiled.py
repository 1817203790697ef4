"""A compiled run renders its sample grids without compiling for them: a grid calls the U-Net in eval mode
at its own batch and shape, which a static-shape compiled U-Net would compile as another graph (minutes for
SD2 on a cold cache, and under compile_mode=reduce-overhead another captured graph and its memory)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.train.conftest import tiny_config
from train.loop.trainer import build_trainer

COMPILED = ("compile=true", "compile_backend=aot_eager", "samples.steps=2", "samples.prompts=[a cat]")


def compiled_graphs(tiny_dataset: str, folder: Path, *extra: str) -> int:
    """Graphs dynamo compiled over a two-step tiny run (the U-Net's forward and backward: one graph)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = tiny_config(tiny_dataset, folder / "save", folder / "cache", *COMPILED, "max_duration=2ba", *extra)
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def test_sample_grids_of_a_compiled_run_add_no_graph(tiny_dataset: str, tmp_path: Path) -> None:
    without = compiled_graphs(tiny_dataset, tmp_path / "without", "samples.enabled=false")
    rendered = compiled_graphs(tiny_dataset, tmp_path / "with", "samples.interval=1ba")
    assert sorted(p.name for p in (tmp_path / "with" / "save" / "samples").glob("*.png")) == [
        "ba00000001.png", "ba00000002.png",
    ]  # fmt: skip
    assert rendered == without == 1
