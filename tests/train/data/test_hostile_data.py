"""A tampered dataset is refused before step 1, naming the problem, or stopped before any checkpoint.

Each test copies one small hashed dataset (as encode writes it: every shard records SHARD_HASH) and damages
one thing, the way an attacker with write access to the bucket, or a broken disk, would.
"""

from __future__ import annotations

import gc
import itertools
import json
import multiprocessing
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from streaming.base.hashing import get_hash

from shared.contract import SHARD_HASH, ContractError
from tests.train.conftest import run_train_cli, tiny_config, tiny_overrides, write_fake_dataset
from train.data.loader import DataError
from train.loop.guards import NonFiniteLossError
from train.loop.prepare import prepare_run
from train.loop.trainer import fit

RES, ROWS, VERSION = 64, 16, "v1"
TEXT_BYTES, LATENT_BYTES = 77 * 32 * 2, 4 * 8 * 8 * 2  # float16 text embedding and latent of the tiny preset
FLOAT16_NAN = np.float16("nan").tobytes()


def index_files(root: Path) -> list[tuple[Path, Path]]:
    """(index.json, the folder its shard basenames are relative to) for every index of the dataset."""
    stream = root / str(RES)
    found = [(stream / "index.json", stream), (root / "versions" / VERSION / str(RES) / "index.json", stream)]
    return found + [(p, p.parent) for p in sorted(stream.glob("*/index.json"))]


def rehash(root: Path, algo: str | None = SHARD_HASH) -> None:
    """Record each shard's current hash in every index (None: remove hashes, as before encode hashed)."""
    for index_path, base in index_files(root):
        index = json.loads(index_path.read_text())
        for shard in index["shards"]:
            data = (base / shard["raw_data"]["basename"]).read_bytes()
            shard["raw_data"]["hashes"] = {algo: get_hash(algo, data)} if algo else {}
        index_path.write_text(json.dumps(index))


@pytest.fixture(scope="module")
def hashed_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "data"
    write_fake_dataset(root, n=ROWS, partitions=1)
    rehash(root)
    return root


@pytest.fixture
def dataset(hashed_dataset: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(hashed_dataset, copy)
    return copy


def edit_json(path: Path, change: Callable[[Any], None]) -> None:
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


def edit_manifests(root: Path, change: Callable[[dict], None]) -> None:
    for path in (root / "manifest.json", root / "versions" / VERSION / "manifest.json"):
        edit_json(path, change)


def edit_indexes(root: Path, change: Callable[[dict], None]) -> None:
    for path, _ in index_files(root)[:2]:  # the merged indexes train reads
        edit_json(path, change)


def first_shard(root: Path) -> Path:
    index = json.loads((root / str(RES) / "index.json").read_text())
    return root / str(RES) / index["shards"][0]["raw_data"]["basename"]


def sample_spans(shard: bytes) -> list[tuple[int, int]]:
    """(start, end) byte offsets of each sample in an MDS shard (a uint32 count, then count + 1 offsets)."""
    count = int(np.frombuffer(shard[:4], "<u4")[0])
    offsets = np.frombuffer(shard[4 : 4 + 4 * (count + 1)], "<u4").tolist()
    return list(itertools.pairwise(offsets))


def overwrite_every_sample(shard_path: Path, patch: Callable[[bytearray, int, int], None]) -> None:
    data = bytearray(shard_path.read_bytes())
    for start, end in sample_spans(bytes(data)):
        patch(data, start, end)
    shard_path.write_bytes(bytes(data))


def nan_latent_means(data: bytearray, start: int, end: int) -> None:
    # Columns are stored in name order: caption, key, latent_logvar, latent_mean, text_embedding.
    mean_at = end - TEXT_BYTES - LATENT_BYTES
    data[mean_at : mean_at + LATENT_BYTES] = FLOAT16_NAN * (LATENT_BYTES // 2)


def non_utf8_caption(data: bytearray, start: int, end: int) -> None:
    data[start + 8] = 0xFF  # after the caption's and key's uint32 sizes: the caption's first byte


def config(root: Path, tmp_path: Path, *extra: str) -> Any:
    return tiny_config(
        str(root), tmp_path / "save", tmp_path / "cache", "max_duration=2ba", "save_interval=1ba",
        "samples.enabled=false", "log.console_interval=10ba", *extra,
    )  # fmt: skip


def assert_no_checkpoint(tmp_path: Path) -> None:
    saved = sorted(p.name for p in (tmp_path / "save").glob("*")) if (tmp_path / "save").exists() else []
    assert not [name for name in saved if name.endswith(".pt") or name.startswith("latest")], saved


# ------------------------------------------------------------------------------ refused before step 1
@pytest.mark.parametrize("scale", [float("nan"), 0.0, -1e30, float("inf")])
def test_nonsense_scale_factor_is_refused(dataset: Path, tmp_path: Path, scale: float) -> None:
    edit_manifests(dataset, lambda m: m.update(scale_factor=scale))
    with pytest.raises(ContractError, match=r"scale_factor is"):
        prepare_run(config(dataset, tmp_path))


@pytest.mark.parametrize(
    ("shape", "value", "match"),
    [((1, 32), 0.0, r"shape \[1, 32\] but text embeddings are \[77, 32\]"), ((77, 32), np.nan, "non-finite")],
)
def test_bad_empty_caption_embedding_is_refused(
    dataset: Path, tmp_path: Path, shape: tuple[int, int], value: float, match: str
) -> None:
    from shared.manifest import encode_array

    bad = encode_array(np.full(shape, value, dtype=np.float16))
    edit_manifests(dataset, lambda m: m.update(empty_caption_embedding=bad))
    with pytest.raises(ContractError, match=match):
        prepare_run(config(dataset, tmp_path))


def test_index_encoding_that_disagrees_with_the_manifest_is_refused(dataset: Path, tmp_path: Path) -> None:
    def smaller_latents(index: dict) -> None:
        for shard in index["shards"]:
            shard["column_encodings"] = [e.replace("4,8,8", "4,4,4") for e in shard["column_encodings"]]
            shard["column_sizes"] = [128 if s == LATENT_BYTES else s for s in shard["column_sizes"]]

    edit_indexes(dataset, smaller_latents)
    with pytest.raises(ContractError, match=r"ndarray:float16:4,4,4.*ndarray:float16:4,8,8"):
        prepare_run(config(dataset, tmp_path))


def test_shard_name_leaving_the_dataset_is_refused(dataset: Path, tmp_path: Path) -> None:
    outside = tmp_path / "x" / "shard.mds"
    outside.parent.mkdir()
    shutil.copyfile(first_shard(dataset), outside)  # a valid shard, but not the dataset's

    def escape(index: dict) -> None:
        index["shards"][0]["raw_data"]["basename"] = "../../../../x/shard.mds"

    edit_indexes(dataset, escape)
    with pytest.raises(ContractError, match=r"basename '\.\./\.\./\.\./\.\./x/shard\.mds'"):
        prepare_run(config(dataset, tmp_path))
    assert not list((tmp_path / "cache").rglob("shard.mds"))  # nothing was written outside either


def test_index_count_that_disagrees_with_the_manifest_is_refused(dataset: Path, tmp_path: Path) -> None:
    edit_indexes(dataset, lambda index: index["shards"][0].update(samples=index["shards"][0]["samples"] + 5))
    with pytest.raises(
        ContractError, match=rf"lists {ROWS + 5} samples but the dataset manifest says {ROWS}"
    ):
        prepare_run(config(dataset, tmp_path))


def test_index_count_that_disagrees_with_its_shard_is_refused(dataset: Path, tmp_path: Path) -> None:
    def move_samples(index: dict) -> None:  # the total still matches the manifest
        index["shards"][0]["samples"] += 3
        index["shards"][1]["samples"] -= 3

    edit_indexes(dataset, move_samples)
    with pytest.raises(ContractError, match=r"holds \d+ samples but its index says \d+"):
        prepare_run(config(dataset, tmp_path))


def test_truncated_shard_is_refused(dataset: Path, tmp_path: Path) -> None:
    shard = first_shard(dataset)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ContractError, match=rf"{shard.name} is \d+ bytes but its index says \d+"):
        prepare_run(config(dataset, tmp_path))


# ---------------------------------------------------------------------- stopped before any checkpoint
@pytest.mark.parametrize(
    "patch", [nan_latent_means, non_utf8_caption], ids=["nan-latents", "non-utf8-caption"]
)
def test_shard_changed_after_encode_fails_its_hash_check(
    dataset: Path, tmp_path: Path, patch: Callable[[bytearray, int, int], None]
) -> None:
    for shard in {first_shard(dataset)}:
        overwrite_every_sample(shard, patch)
    with pytest.raises(DataError, match=rf"do not match the {SHARD_HASH} hash"):
        fit(config(dataset, tmp_path))
    assert_no_checkpoint(tmp_path)
    # Streaming checks a hash only on download: the damaged copy it kept in the cache was read unchecked
    # by the next run (which trained on it and exited 0), or the shard stayed "being prepared" (a hang).
    damaged = first_shard(dataset).relative_to(dataset / str(RES))
    cached = [p for p in (tmp_path / "cache").rglob("shard.*") if p.as_posix().endswith(damaged.as_posix())]
    assert not cached, cached
    with pytest.raises(DataError, match=rf"do not match the {SHARD_HASH} hash"):
        fit(config(dataset, tmp_path))
    assert_no_checkpoint(tmp_path)


@pytest.mark.timeout(90)  # the hang fails here
def test_a_damaged_shard_fails_every_loader_worker_that_needs_it(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streaming left a shard that failed in one loader worker "being prepared" in the state its workers
    share: another worker that needed it waited for it forever, and the training process for that worker's
    batch (a hang). Here worker 1 meets the damage first, and worker 0, whose batch comes first, needs the
    shard too."""
    import torch.utils.data
    from streaming import StreamingDataset

    from train.data.loader import build_dataloader

    def started_late_in_worker_0(thread: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        def run(self: Any, it: Any) -> None:
            worker = torch.utils.data.get_worker_info()
            if worker is not None and worker.id == 0:
                time.sleep(2)
            thread(self, it)

        return run

    for name in ("_prepare_thread", "_ready_thread"):
        monkeypatch.setattr(StreamingDataset, name, started_late_in_worker_0(getattr(StreamingDataset, name)))
    overwrite_every_sample(first_shard(dataset), nan_latent_means)
    cfg = config(dataset, tmp_path, "data.num_workers=2")
    loader = build_dataloader(cfg.data, prepare_run(cfg).pinned, 8, cfg.seed)
    with pytest.raises(DataError, match=rf"do not match the {SHARD_HASH} hash"):
        list(loader)
    # Its workers are gone with its iterator: torch terminated a busy one and went on, and that worker still
    # took Streaming's cache lock, leaving the lock file its dataset had removed.
    del loader
    gc.collect()
    assert multiprocessing.active_children() == []


def test_a_damaged_shard_read_by_a_loader_worker_is_one_line_from_the_cli(
    dataset: Path, tmp_path: Path
) -> None:
    """The shipped recipes read in loader workers (8 a rank), whose error torch raises in the training process
    built from the worker's traceback as text: the CLI's one line was that traceback."""
    overwrite_every_sample(first_shard(dataset), nan_latent_means)
    overrides = tiny_overrides(
        str(dataset), tmp_path / "save", tmp_path / "cache", "max_duration=2ba", "samples.enabled=false",
        "data.num_workers=2",
    )  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    proc = run_train_cli(["fit", "tiny", *overrides], **pipes)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()  # a hang fails the test, not the suite's temp-folder checks
    assert proc.returncode == 2, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: Checksum failure: "), last
    assert f"do not match the {SHARD_HASH} hash" in last, last
    assert_no_checkpoint(tmp_path)


def test_a_temp_folder_too_long_for_the_loader_workers_sockets_is_one_line_not_a_hang(
    dataset: Path, tmp_path: Path
) -> None:
    """A worker hands its batch over through a Unix socket in TMPDIR (at most 107 bytes a path): with a
    longer temp folder its send failed in a thread that only printed the traceback, and the run waited for
    that batch forever. The supervisor's control folder adds ~25 bytes to the TMPDIR it gives the ranks."""
    temp = tmp_path / ("t" * 80)
    temp.mkdir()
    overrides = tiny_overrides(
        str(dataset), tmp_path / "save", tmp_path / "cache", "max_duration=2ba", "samples.enabled=false",
        "data.num_workers=2",
    )  # fmt: skip
    proc = run_train_cli(
        ["fit", "tiny", *overrides], temp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 2, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    last = err.strip().splitlines()[-1]
    assert "is too long for the Unix sockets loader workers hand their batches over by" in last, last
    assert last.endswith("or data.num_workers=0"), last
    assert_no_checkpoint(tmp_path)


@pytest.mark.s3
def test_a_shard_deleted_from_s3_after_encode_is_a_data_error(s3_prefix: str, tmp_path: Path) -> None:
    """Deleted by `encode gc --force`, a lifecycle rule or by hand: one line naming the shard, not Streaming's
    ~260-line "Background thread failed" traceback (local shards are checked before step 1)."""
    from shared import storage

    root = f"{s3_prefix}/data"
    write_fake_dataset(root, n=64, seed=5)
    index = json.loads(storage.read_bytes(f"{root}/{RES}/index.json"))
    missing = f"{root}/{RES}/{index['shards'][0]['raw_data']['basename']}"
    storage.delete(missing)
    with pytest.raises(DataError, match=rf"index names is missing \(Object {missing} not found!\)"):
        fit(
            tiny_config(
                root, tmp_path / "save", tmp_path / "cache", "max_duration=2ba", "samples.enabled=false"
            )
        )
    assert_no_checkpoint(tmp_path)


def test_nan_latents_in_an_unhashed_dataset_stop_training_before_a_checkpoint(
    dataset: Path, tmp_path: Path
) -> None:
    for index_path, base in index_files(dataset):
        for shard in json.loads(index_path.read_text())["shards"]:
            path = base / shard["raw_data"]["basename"]
            if path.exists() and index_path.parent == path.parent:  # each file once, via its partition
                overwrite_every_sample(path, nan_latent_means)
    rehash(dataset, None)  # a dataset written before encode hashed its shards
    with pytest.raises(NonFiniteLossError, match=r"batch 1: the loss became NaN"):
        fit(config(dataset, tmp_path))
    assert_no_checkpoint(tmp_path)


def test_non_utf8_caption_in_an_unhashed_dataset_trains(dataset: Path, tmp_path: Path) -> None:
    """Training never reads captions: bytes that are not UTF-8 there cannot stop it."""
    overwrite_every_sample(first_shard(dataset), non_utf8_caption)
    rehash(dataset, None)
    trainer = fit(config(dataset, tmp_path))
    assert int(trainer.state.timestamp.batch) == 2
