"""A closed trainer lets go of everything it held, in a process that goes on (the bench's sections, a
notebook, the suite's workers).

Composer keeps an at-exit close of every trainer after close(), its FileLogger wraps sys.stdout and
sys.stderr for good, torch's distributed-checkpoint helper caches every model it saw, and our cache of which
callback classes handle which events kept classes made per call. Each held the trainer's State: its model,
optimizer and dataloader, and through the dataset 14 descriptors and a /dev/shm prefix, until the process
ended (one bench run held 4,900 descriptors; CI's workers, under a limit of 1,024, then failed every later
test with EMFILE).
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

from tests.train.conftest import tiny_config
from tests.train.data.test_streaming_lock import registrations_of, shm_descriptors
from train.loop.trainer import build_trainer


def test_a_closed_trainer_is_collected_with_its_datasets_shared_memory(
    tiny_dataset: str, tmp_path: Path
) -> None:
    writes_before = [vars(stream).get("write") for stream in (sys.stdout, sys.stderr)]
    shm_before = shm_descriptors()
    cfg = tiny_config(
        tiny_dataset, tmp_path / "save", tmp_path / "cache", "max_duration=2ba", "samples.enabled=false"
    )
    trainer = build_trainer(cfg)
    local = trainer.state.train_dataloader.dataset.streams[0].local
    assert registrations_of(local)  # the live dataset is registered
    trainer.fit()
    state = weakref.ref(trainer.state)
    trainer.close()
    del trainer
    gc.collect()
    assert state() is None, "the closed trainer's State is still referenced"
    assert not registrations_of(local), "its dataset's shared memory is still registered"
    assert shm_descriptors() <= shm_before
    assert [vars(stream).get("write") for stream in (sys.stdout, sys.stderr)] == writes_before
