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
