"""A training run holds a lease on the dataset version it streams (issue 10.5; shared/leases.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shared import leases
from shared.manifest import read_manifest
from tests.train.conftest import single_threaded_torch, tiny_config
from train.data import lease as lease_module
from train.data.lease import DatasetLease


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_lease_is_refreshed_at_most_once_per_period_and_released(tmp_path: Path) -> None:
    clock = FakeClock()
    callback = DatasetLease(str(tmp_path), "v1", "run-a", refresh_s=300, ttl_s=1800, clock=clock)
    callback.fit_start(None, None)  # type: ignore[arg-type]
    (held,) = leases.list_leases(str(tmp_path))[0]
    assert (held.version, held.job, held.expires) == ("v1", "run-a", clock.now + 1800)
    for _ in range(100):  # 100 steps of 2 s: 200 s, inside one refresh period
        clock.now += 2
        callback.batch_end(None, None)  # type: ignore[arg-type]
    assert callback.writes == 1
    clock.now += 100  # 300 s since the first write
    callback.batch_end(None, None)  # type: ignore[arg-type]
    callback.batch_end(None, None)  # type: ignore[arg-type]
    callback.refreshing.finish()  # refreshes are written by a background thread
    assert callback.writes == 2
    assert leases.list_leases(str(tmp_path))[0][0].expires == clock.now + 1800
    callback.fit_end(None, None)  # type: ignore[arg-type]
    callback.close(None, None)  # type: ignore[arg-type]
    assert leases.list_leases(str(tmp_path)) == ([], {})


def test_a_tiny_run_writes_its_lease_and_removes_it(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from train.loop.trainer import fit

    data = tmp_path / "data"
    # The shared dataset stays untouched; its leases are not copied (a run killed by another test keeps its
    # lease until it expires, as it should: it may be resumed).
    shutil.copytree(tiny_dataset, data, ignore=shutil.ignore_patterns(leases.LEASES_DIRNAME))
    seen: list[list[leases.Lease]] = []
    real_write = lease_module.write_lease

    def write_and_look(*args: object, **kwargs: object) -> leases.Lease:
        written = real_write(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(leases.list_leases(str(data))[0])
        return written

    monkeypatch.setattr(lease_module, "write_lease", write_and_look)
    cfg = tiny_config(
        str(data), tmp_path / "save", tmp_path / "cache", "max_duration=2ba", "samples.enabled=false"
    )
    with single_threaded_torch():
        fit(cfg)
    version = read_manifest(str(data)).version
    assert len(seen) == 1 and [(lease.version, lease.job) for lease in seen[0]] == [
        (version, cfg.resolved_run_name())
    ]
    assert leases.list_leases(str(data)) == ([], {}), "the lease outlived the run"


def test_the_leases_are_held_from_the_pin_on_and_the_held_out_set_has_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training data's lease was first written at FIT_START, after the model build and the checkpoint
    load (minutes for SD2-base from S3): `encode gc` deleted the pinned version meanwhile, and the run then
    failed on its missing shards. The held-out set (eval.uri, read at the first eval, hours in) had no
    lease at all: a re-encode and gc killed the run there (exit 2)."""
    from tests.train.conftest import write_fake_dataset
    from train.loop import trainer as trainer_module
    from train.loop.trainer import fit

    data, heldout = tmp_path / "data", tmp_path / "heldout"
    write_fake_dataset(data, n=16)
    write_fake_dataset(heldout, n=8, seed=5, salt="held-out")
    held_at_build: list[list[str]] = []
    real_build = trainer_module.build_model

    def build_and_look(ctx: object) -> object:
        held_at_build.append([lease.version for lease in leases.list_leases(str(data))[0]])
        return real_build(ctx)  # type: ignore[arg-type]

    monkeypatch.setattr(trainer_module, "build_model", build_and_look)
    held_in_training: list[list[str]] = []
    real_write = lease_module.write_lease

    def write_and_look(*args: object, **kwargs: object) -> leases.Lease:
        written = real_write(*args, **kwargs)  # type: ignore[arg-type]
        held_in_training.append([lease.version for lease in leases.list_leases(str(heldout))[0]])
        return written

    monkeypatch.setattr(lease_module, "write_lease", write_and_look)
    cfg = tiny_config(
        str(data), tmp_path / "save", tmp_path / "cache", "max_duration=2ba", "samples.enabled=false",
        f"eval.uri={heldout}", "eval.num_samples=4", "eval.timesteps=[500]", "eval.interval=2ba",
    )  # fmt: skip
    with single_threaded_torch():
        fit(cfg)
    assert held_at_build == [["v1"]], "no lease while the model was built"
    assert ["v1"] in held_in_training, "the held-out set was never leased"
    assert leases.list_leases(str(heldout)) == ([], {}), "the held-out set's lease outlived the run"
