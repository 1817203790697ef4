"""Data side of `make bench`: a real MDS dataset on disk, train's real loader over it, and the real Composer
trainer on it compared with the bare step.

The dataset is written the way encode lays out its output (shared/manifest.py): rows at the preset's exact
shapes through `streaming.MDSWriter` + `shared.contract`, one partition, a merged index per version and a
manifest, so `train.data` and `train.trainer` read it exactly as they read a real encode output.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.contract import LATENT_MEAN, Shapes, make_row, mds_columns
from shared.manifest import INDEX_NAME, DatasetManifest, Layout, ResolutionInfo, fingerprint
from shared.presets import Preset
from shared.runtime import DeviceSetup
from train.bench.step import train_step
from train.bench.syncs import Readbacks, count_readbacks, step_tracker
from train.config import DataConfig, TrainConfig
from train.data import build_dataloader, pin_version, read_dataset_manifest
from train.trainer import build_trainer

if TYPE_CHECKING:
    from composer import Trainer

VERSION = "bench"
PARTITION = "part00000-bench"
# Encode's default shard size (encode.config.OutputConfig.shard_size_limit): the loader sees real shards.
SHARD_SIZE_LIMIT = 1 << 27
READ_CHUNK = 1 << 24
LOGVAR_RANGE = (-6.0, -2.0)  # typical stored posterior log-variances; values do not affect speed


# ---------------------------------------------------------------------------------------------- dataset
def write_synthetic_dataset(
    root: Path, preset: Preset, resolution: int, rows: int, seed: int
) -> DatasetManifest:
    """An encode output at `root` holding `rows` random rows at the preset's shapes for one resolution."""
    from streaming import MDSWriter

    shapes = Shapes(preset.latent_shape(resolution), preset.text_shape())
    layout = Layout(str(root))
    part_dir = Path(layout.partition_output(resolution, PARTITION))
    rng = np.random.default_rng(seed)
    with MDSWriter(out=str(part_dir), columns=mds_columns(shapes), size_limit=SHARD_SIZE_LIMIT) as writer:
        for i in range(rows):
            mean = rng.standard_normal(shapes.latent, dtype=np.float32)
            logvar = rng.uniform(*LOGVAR_RANGE, shapes.latent)
            text = rng.standard_normal(shapes.text, dtype=np.float32)
            writer.write(make_row(f"{i:09d}", f"bench caption {i}", mean, logvar, text))
    index = _index_below_stream_root(part_dir)
    for uri in (layout.version_index(VERSION, resolution), layout.current_index(resolution)):
        _write_json(Path(uri), index)
    size = sum(p.stat().st_size for p in part_dir.glob("*.mds"))
    manifest = DatasetManifest(
        version=VERSION,
        created=datetime.now(UTC).isoformat(),
        preset=preset.name,
        scale_factor=preset.scale_factor,
        resolutions={
            resolution: ResolutionInfo(rows, shapes, size, 0, fingerprint([seed, rows, resolution]))
        },
        rejected={},
        samples_read=rows,
        fingerprints={"dataset": fingerprint(["bench", preset.name, seed, rows, resolution]), "encoders": {}},
        empty_caption_embedding=np.zeros(shapes.text, dtype=np.float16),
        partitions=[{"id": PARTITION, "dirs": {str(resolution): PARTITION}}],
        config={"preset": preset.name, "encoder": {}},
    )
    for uri in (layout.version_manifest(VERSION), layout.manifest):
        _write_json(Path(uri), manifest.to_json())
    return manifest


def _index_below_stream_root(part_dir: Path) -> dict[str, Any]:
    """The partition's MDS index, shard paths made relative to the stream root (as encode merges them)."""
    index = json.loads((part_dir / INDEX_NAME).read_text())
    for shard in index["shards"]:
        for key in ("raw_data", "zip_data"):
            if shard.get(key):
                shard[key]["basename"] = f"{part_dir.name}/{shard[key]['basename']}"
    return index


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def shard_files(root: Path, resolution: int) -> list[Path]:
    return sorted(Path(Layout(str(root)).stream_root(resolution)).rglob("*.mds"))


# ----------------------------------------------------------------------------------------------- reading
def raw_read_bytes_per_s(files: list[Path], repeats: int) -> tuple[float, int]:
    """(median bytes/s, bytes) of reading the shard files start to end with plain file reads.

    The files were just written, so this mostly measures the page cache: an upper bound for any reader.
    """
    total = sum(p.stat().st_size for p in files)
    seconds = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        for path in files:
            with path.open("rb", buffering=0) as handle:
                while handle.read(READ_CHUNK):
                    pass
        seconds.append(time.perf_counter() - start)
    return total / statistics.median(seconds), total


def data_config(root: Path, resolution: int, cache_dir: Path, num_workers: int) -> Any:
    return DataConfig(
        uri=str(root),
        resolution=resolution,
        cache_dir=str(cache_dir),
        num_workers=num_workers,
        num_canonical_nodes=1,
    )


@dataclass
class LoaderRun:
    """One pass over the dataset: when the first batch arrived, and the samples and seconds after it."""

    first_batch_s: float
    samples_after_first: int
    seconds_after_first: float

    @property
    def images_per_s(self) -> float:
        return self.samples_after_first / max(self.seconds_after_first, 1e-9)


def _one_pass(loader: Any) -> LoaderRun:
    start = time.perf_counter()
    first = last = None
    samples = 0
    for batch in loader:
        last = time.perf_counter()
        if first is None:  # worker start-up and the first shard's copy: reported apart, not in the rate
            first = last
            continue
        samples += int(batch[LATENT_MEAN].shape[0])
    if first is None or last is None:
        raise ValueError("the bench dataset yielded no batch: raise loader.rows above the batch size")
    return LoaderRun(first - start, samples, last - first)


def bench_loader(
    root: Path, resolution: int, batch_size: int, num_workers: int, passes: int, cache_dir: Path, seed: int
) -> dict[str, Any]:
    """Train's real StreamingDataLoader over the dataset: images/s per pass (pass 1 copies shards in)."""
    cfg = data_config(root, resolution, cache_dir, num_workers)
    pinned = pin_version(cfg, read_dataset_manifest(cfg))
    loader = build_dataloader(cfg, pinned, batch_size, seed)
    runs = [_one_pass(loader) for _ in range(max(passes, 1))]
    del loader
    gc.collect()  # shuts the persistent workers down and releases Streaming's shared memory
    rates = [r.images_per_s for r in runs]
    warm = rates[1:] or rates
    return {
        "images_per_s": statistics.median(warm),
        "images_per_s_by_pass": rates,  # pass 1: cold local cache (shards copied from the "remote" folder)
        "first_batch_s": runs[0].first_batch_s,
        "batch_size": batch_size,
        "num_workers": num_workers,
    }


# ----------------------------------------------------------------------------------------------- trainer
@dataclass
class BatchRecord:
    """One Composer batch: its wall time (BEFORE_DATALOADER to the next), parts of it, and the bare step
    timed right after it on the same model, optimizer and batch (so both see the same machine load)."""

    start: float
    fetch_s: float = 0.0
    components_s: dict[str, float] = field(default_factory=dict)
    bare_step_s: float = 0.0
    wall_s: float = 0.0  # Composer's time for this batch, the interleaved bare step taken out


@dataclass
class BatchClock:
    """Times every Composer batch and, after each, one bare step; `sync` waits for the device."""

    sync: Callable[[], None]
    bare_step: Callable[[Any], Any]  # the batch as the loader delivered it -> one train_step
    records: list[BatchRecord] = field(default_factory=list)
    _open: BatchRecord | None = None

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def start_batch(self) -> None:
        now = self.now()
        if self._open is not None:
            self._open.wall_s = now - self._open.start - self._open.bare_step_s
            self.records.append(self._open)
        self._open = BatchRecord(now)

    def fetched(self) -> None:
        if self._open is not None:
            self._open.fetch_s = self.now() - self._open.start

    def add(self, name: str, seconds: float) -> None:
        if self._open is not None:
            self._open.components_s[name] = self._open.components_s.get(name, 0.0) + seconds

    def run_bare_step(self, batch: Any) -> None:
        if self._open is None:
            return
        start = self.now()
        self.bare_step(batch)
        self._open.bare_step_s = self.now() - start


def _batch_clock_callback(clock: BatchClock) -> Any:
    from composer.core import Callback

    class BatchClockCallback(Callback):
        """Last in the callback list, so at BATCH_END the EMA and every other callback have run."""

        def before_dataloader(self, state: Any, logger: Any) -> None:
            clock.start_batch()

        def after_dataloader(self, state: Any, logger: Any) -> None:
            clock.fetched()

        def batch_end(self, state: Any, logger: Any) -> None:
            clock.run_bare_step(state.batch)

    return BatchClockCallback()


def _timed(fn: Callable[..., Any], name: str, clock: BatchClock) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock.now()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.add(name, clock.now() - start)

    return wrapper


def instrument(trainer: Trainer, clock: BatchClock) -> None:
    """Time every algorithm (EMA, gradient clipping) and callback/logger; drop checkpointing.

    Composer saves a checkpoint at the end of any run: for SD2 shapes that is a multi-GB write that a real
    run pays once per save_interval, not per batch, so the bench leaves it out.
    """
    from composer.callbacks import CheckpointSaver

    state = trainer.state
    state.callbacks[:] = [cb for cb in state.callbacks if not isinstance(cb, CheckpointSaver)]
    for algorithm in state.algorithms:
        algorithm.apply = _timed(algorithm.apply, type(algorithm).__name__, clock)  # type: ignore[method-assign]
    for callback in state.callbacks:
        callback.run_event = _timed(callback.run_event, type(callback).__name__, clock)  # type: ignore[method-assign]
    state.callbacks.append(_batch_clock_callback(clock))


def trainer_config(
    recipe: TrainConfig,
    root: Path,
    resolution: int,
    batch_size: int,
    batches: int,
    work: Path,
    setup: DeviceSetup,
) -> TrainConfig:
    """The recipe on the bench dataset: one device, one microbatch per step, no sample grids."""
    import dataclasses

    data = dataclasses.replace(
        recipe.data, uri=str(root), resolution=resolution, cache_dir=str(work / "cache")
    )
    log = dataclasses.replace(recipe.log, local_dir=str(work / "run"), tensorboard=False, wandb_project=None)
    return dataclasses.replace(
        recipe,
        data=data,
        samples=dataclasses.replace(recipe.samples, enabled=False),  # rendered every few thousand steps
        log=log,
        global_batch_size=batch_size,
        device_microbatch_size=batch_size,
        max_duration=f"{batches}ba",
        save_folder=str(work / "save"),
        save_interval=f"{batches + 1}ba",
        autoresume=False,
        load_path=None,
        load_weights_only=False,
        fsdp=False,  # one device: nothing to shard
        device=setup.kind,
        precision=setup.precision,
        run_name="bench",
    )


def bench_trainer(
    recipe: TrainConfig,
    root: Path,
    resolution: int,
    batch_size: int,
    batches: int,
    warmup: int,
    work: Path,
    setup: DeviceSetup,
) -> dict[str, Any]:
    """Composer's wall time per batch (data, EMA, clipping, callbacks, logging included) vs the bare step,
    timed after every batch on the trainer's own model, optimizer and batch."""
    # One batch more than timed: the last one ends at FIT_END, not at a next BEFORE_DATALOADER.
    cfg = trainer_config(recipe, root, resolution, batch_size, warmup + batches + 1, work, setup)
    trainer = build_trainer(cfg)
    state = trainer.state
    optimizer = state.optimizers[0]

    def bare_step(batch: Any) -> None:
        train_step(state.model, optimizer, state.device.batch_to_device(batch), setup)

    clock = BatchClock(setup.sync, bare_step)
    instrument(trainer, clock)
    with count_readbacks() as reads:
        trainer.state.callbacks.insert(0, step_tracker(reads))
        try:
            trainer.fit()
        finally:
            trainer.close()
    timed_steps = range(warmup + 1, warmup + batches + 1)
    return summarize_batches(clock.records[warmup:], batch_size) | {
        "host_reads_per_step": reads_per_step(reads, timed_steps)
    }


def reads_per_step(reads: Readbacks, steps: range) -> dict[str, Any]:
    """Median and max read-backs (host syncs on a GPU) per timed step, by who makes them: the train job
    (logging flushes every log.console_interval) and Composer's loop, with the places Composer reads."""
    out: dict[str, Any] = {}
    for who in ("train/", "composer/", "diffusers/"):
        counts = [sum(n for w, n in reads.at(s).items() if w.startswith(who)) for s in steps]
        out[who.rstrip("/")] = {"median": statistics.median(counts), "max": max(counts)}
    out["composer_places"] = sorted({w for s in steps for w in reads.at(s) if w.startswith("composer/")})
    return out


def summarize_batches(records: list[BatchRecord], batch_size: int) -> dict[str, Any]:
    """Medians over the timed batches: Composer's wall time, the bare step, their gap and its parts."""
    if not records:
        raise ValueError("the trainer bench timed no batch: raise trainer.batches")
    wall = statistics.median(r.wall_s for r in records)
    bare = statistics.median(r.bare_step_s for r in records)
    outside = statistics.median(max(0.0, 1.0 - r.bare_step_s / r.wall_s) for r in records)
    names = sorted({name for r in records for name in r.components_s})
    components = {name: statistics.median(r.components_s.get(name, 0.0) for r in records) for name in names}
    # Composer's own loop: batch to device, microbatch split, loss sync and logging, scheduler step
    unattributed = statistics.median(
        r.wall_s - r.bare_step_s - r.fetch_s - sum(r.components_s.values()) for r in records
    )
    return {
        "batches_timed": len(records),
        "batch_size": batch_size,
        "wall_per_batch_s": wall,
        "images_per_s": batch_size / wall,
        "bare_step_s": bare,
        "outside_step_share": outside,  # median over batches of 1 - bare / wall
        "data_fetch_s": statistics.median(r.fetch_s for r in records),
        "components_s": {name: s for name, s in components.items() if s > 0},
        "unattributed_s": unattributed,
    }
