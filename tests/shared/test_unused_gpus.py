"""Issue 22 (5): `make train` / `make encode` without GPUS= on a machine with several GPUs runs one process
on one GPU; it says so, loudly, with the command that uses them all (no GPU here: the count is passed in)."""

from __future__ import annotations

from shared.runtime.device import unused_gpus_warning


def test_several_gpus_without_a_launcher_are_named_with_the_fix() -> None:
    line = unused_gpus_warning("train", device_count=8, env={})
    assert "8 GPUs are visible" in line and "ONE GPU" in line and "make train GPUS=8" in line
    assert "make encode GPUS=4" in unused_gpus_warning("encode", device_count=4, env={})


def test_silent_with_one_gpu_or_under_a_launcher() -> None:
    assert unused_gpus_warning("train", device_count=1, env={}) == ""
    assert unused_gpus_warning("train", device_count=0, env={}) == ""
    assert unused_gpus_warning("train", device_count=8, env={"WORLD_SIZE": "8"}) == ""
