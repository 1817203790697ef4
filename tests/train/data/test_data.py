"""Streaming: version pinning into a private cache folder, row format, per-sample seeds, folder ownership."""

from __future__ import annotations

import json
import subprocess
import sys
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import pytest
import torch

from shared.contract import LATENT_MEAN, TEXT_EMBEDDING, TEXT_TOKENS
from shared.manifest import Layout
from tests.train.conftest import write_fake_dataset
from train.config import DataConfig
from train.data.loader import (
    SAMPLE_SEED,
    STREAM_INDEX,
    TRAIN_COLUMNS,
    DataError,
    build_dataset,
    cache_dir_for,
    pin_version,
    read_dataset_manifest,
)
from train.data.shm import read_shm
from train.data.streaming_host import claim_local_dir, remove_stale_registrations


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("versions") / "data"
    write_fake_dataset(root, n=16, version="v1", seed=0)
    write_fake_dataset(root, n=24, version="v2", seed=1)  # new partitions; v1's stay where they were
    return str(root)


def pinned_for(root: str, cache: Path, version: str | None = None) -> object:
    cfg = DataConfig(uri=root, resolution=64, version=version, cache_dir=str(cache), num_workers=0)
    return pin_version(cfg, read_dataset_manifest(cfg))


def test_current_version_is_pinned_by_default(two_versions: str, tmp_path: Path) -> None:
    pinned = pinned_for(two_versions, tmp_path)
    assert (pinned.version, pinned.num_samples) == ("v2", 24)
    placed = json.loads((Path(pinned.local) / "index.json").read_text())
    assert placed == json.loads(Path(Layout(two_versions).version_index("v2", 64)).read_text())
    assert pinned.local == cache_dir_for(str(tmp_path), two_versions, "v2", 64)


def test_older_version_streams_its_own_index(two_versions: str, tmp_path: Path) -> None:
    pinned = pinned_for(two_versions, tmp_path, version="v1")
    assert (pinned.version, pinned.num_samples) == ("v1", 16)
    dataset = build_dataset(DataConfig(shuffle=False), pinned, per_rank_batch=4, seed=3)
    assert len(dataset) == 16
    assert pinned.local != cache_dir_for(str(tmp_path), two_versions, "v2", 64)


def test_stale_local_index_is_replaced(two_versions: str, tmp_path: Path) -> None:
    local = Path(cache_dir_for(str(tmp_path), two_versions, "v1", 64))
    local.mkdir(parents=True)
    (local / "index.json").write_text(json.dumps({"version": 2, "shards": []}))
    pinned = pinned_for(two_versions, tmp_path, version="v1")
    assert len(json.loads((Path(pinned.local) / "index.json").read_text())["shards"]) > 0


def test_missing_version_is_a_clear_error(two_versions: str, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make encode"):
        pinned_for(two_versions, tmp_path, version="v9")


@pytest.mark.parametrize(
    ("limit", "says"), [("1kb", "Minimum cache usage"), ("20kb", "four times the largest")]
)
def test_a_cache_limit_below_what_streaming_needs_is_one_error_naming_the_setting(
    tiny_dataset: str, tmp_path: Path, limit: str, says: str
) -> None:
    """Streaming refuses a cache_limit under the dataset's indexes or four of its largest shards; every rank
    printed its traceback. The refusal is now a DataError (one line on the CLI) naming data.cache_limit."""
    cfg = DataConfig(
        uri=tiny_dataset, resolution=64, cache_dir=str(tmp_path), num_workers=0, cache_limit=limit
    )
    pinned = pin_version(cfg, read_dataset_manifest(cfg))
    with pytest.raises(DataError, match=f"data.cache_limit={limit} is too small for this dataset: .*{says}"):
        build_dataset(cfg, pinned, per_rank_batch=4, seed=5)
    cfg = DataConfig(
        uri=tiny_dataset, resolution=64, cache_dir=str(tmp_path / "b"), num_workers=0, cache_limit="64mb"
    )
    assert len(list(build_dataset(cfg, pin_version(cfg, read_dataset_manifest(cfg)), 4, seed=5))) == 64


def test_rows_hold_only_precomputed_columns_and_a_stable_seed(tiny_dataset: str, tmp_path: Path) -> None:
    def seeds_and_rows(cache: Path) -> tuple[list[int], dict]:
        pinned = pinned_for(tiny_dataset, cache)
        dataset = build_dataset(DataConfig(shuffle=True), pinned, per_rank_batch=4, seed=5)
        rows = list(dataset)
        return [int(r[SAMPLE_SEED]) for r in rows], rows[0]

    first, row = seeds_and_rows(tmp_path / "a")
    again, _ = seeds_and_rows(tmp_path / "b")
    # TRAIN_COLUMNS holds both text columns; an embeddings dataset's rows carry TEXT_EMBEDDING only.
    stored = set(TRAIN_COLUMNS) - {TEXT_TOKENS}
    # the seed of the sample's draws (train/data/draws.py); which data.streams stream (0 for one dataset)
    assert set(row) == {*stored, SAMPLE_SEED, STREAM_INDEX}
    assert row[STREAM_INDEX] == 0
    assert row[LATENT_MEAN].dtype == torch.float16 and tuple(row[LATENT_MEAN].shape) == (4, 8, 8)
    assert tuple(row[TEXT_EMBEDDING].shape) == (77, 32)
    assert len(first) == 64 and len(set(first)) == 64 and first == again


def test_a_folder_held_by_a_live_process_is_refused(tmp_path: Path) -> None:
    local = tmp_path / "held"
    local.mkdir()
    hold = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"
    )
    lock = str(local / ".sd-pretrain.lock")
    holder = subprocess.Popen([sys.executable, "-c", hold, lock], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(DataError, match=r"data\.cache_dir"):
            claim_local_dir(str(local))
    finally:
        holder.kill()
        holder.wait()


def test_stale_registration_of_our_folder_is_removed(tmp_path: Path) -> None:
    from streaming.base.constant import LOCALS
    from streaming.base.shared.prefix import _get_path, _pack_locals, _unpack_locals

    local = str(tmp_path / "stale")
    prefix = 0
    while True:  # the first free prefix, claimed atomically: other jobs on this host pick prefixes too
        data = _pack_locals([local], prefix)
        try:
            shm = shared_memory.SharedMemory(name=_get_path(prefix, LOCALS), create=True, size=len(data))
            break
        except FileExistsError:
            prefix += 1
    shm.buf[: len(data)] = data
    shm.close()  # left behind, like a run killed with SIGKILL: no longer this process's to unlink at exit
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    assert remove_stale_registrations(local) >= 1
    # The name may already be another job's again (a suite running beside this one): then it must be
    # that job's registration, not ours.
    again = read_shm(_get_path(prefix, LOCALS))
    assert again is None or local not in _unpack_locals(again)[0]


def test_two_live_runs_on_one_hosts_data_each_get_their_own_default_cache(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """A sweep on one host's data: the second run was refused ('another process is streaming through ...')
    until given a data.cache_dir of its own. In the default root each run (by save folder) has its own."""
    from train.config import DataConfig
    from train.data.loader import pin_version, read_dataset_manifest

    cfg = DataConfig(uri=tiny_dataset, resolution=64)  # data.cache_dir unset: the default root
    run_a = str(tmp_path / "run-a")
    pin_a = (  # holds its cache folder until its stdin closes, then exits as a run does
        "import sys; from train.config import DataConfig; "
        "from train.data.loader import pin_version, read_dataset_manifest; "
        f"cfg = DataConfig(uri={tiny_dataset!r}, resolution=64); "
        f"print(pin_version(cfg, read_dataset_manifest(cfg), {run_a!r}).local, flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", pin_a], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        held = holder.stdout.readline().strip()  # type: ignore[union-attr]
        assert held, "the other run never pinned its data"
        mine = pin_version(cfg, read_dataset_manifest(cfg), str(tmp_path / "run-b"))  # not refused
        assert mine.local != held and Path(mine.local).parent == Path(held).parent
    finally:
        holder.stdin.close()  # type: ignore[union-attr]
        holder.wait(timeout=60)


def test_a_finished_run_removes_its_own_default_cache(tiny_dataset: str, tmp_path: Path) -> None:
    """Each run of a host's data has its own copy of the shards in the default root: a finished run's went
    with it (nothing else removes it; a stopped or crashed run keeps its copy for the resume)."""
    from tests.train.conftest import single_threaded_torch, tiny_config
    from train.data.loader import cache_dir_for, read_dataset_manifest
    from train.loop.trainer import fit

    save = tmp_path / "save"
    cfg = tiny_config(tiny_dataset, save, "", "max_duration=2ba", "samples.enabled=false")
    version = read_dataset_manifest(cfg.data).version
    folder = Path(cache_dir_for("", tiny_dataset, version, 64, str(save)))
    with single_threaded_torch():
        fit(cfg)
    assert folder.name.startswith("run-") and not folder.exists() and folder.parent.exists()
