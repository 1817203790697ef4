"""The trainer section of `make bench`: the real Composer trainer over the bench dataset, each batch timed
against the U-Net forward/backward and optimizer step inside it and against a bare step on the same batch.

Timing a part waits for the device before and after it, so those batches run serialised: every millisecond
of Python (events, callbacks, clipping's and the EMA's launches) shows, where a training run, which never
waits for the device inside a step, overlaps it with the kernels still queued. So the section ends with
`flow_batches` batches timed only as a whole, as a run runs them, against as many bare steps back to back:
what Composer adds to the step in a real run (issue 30 item 5), beside where its time goes.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shared.runtime.device import DeviceSetup
from train.bench.anatomy.profile import profile_calls, python_calls
from train.bench.step import train_step
from train.bench.trainer.counts import BatchCounts, counting_callback
from train.bench.trainer.syncs import Readbacks, count_readbacks, step_tracker
from train.config import TrainConfig
from train.data.packing import unpack
from train.loop.trainer import build_trainer
from train.model.assemble import forget_compiled_code

if TYPE_CHECKING:
    from composer import Trainer


@dataclass
class BatchRecord:
    """One Composer batch: its wall time (BEFORE_DATALOADER to the next), parts of it, and the bare step
    timed right after it on the same model, optimizer and batch (so both see the same machine load)."""

    start: float
    fetch_s: float = 0.0
    components_s: dict[str, float] = field(default_factory=dict)
    # the U-Net forward + loss, backward and optimizer step as Composer runs them in this batch
    in_step_s: float = 0.0
    bare_step_s: float = 0.0
    wall_s: float = 0.0  # Composer's time for this batch, the interleaved bare step taken out


@dataclass
class BatchClock:
    """Times every Composer batch and, after each, one bare step; `sync` waits for the device."""

    sync: Callable[[], None]
    bare_step: Callable[[Any], Any]  # the batch as the loader delivered it -> one train_step
    attributed: int  # the first batches, timed part by part; the rest run unsynced (`flow`)
    flow_batches: int = 0
    records: list[BatchRecord] = field(default_factory=list)
    started: int = 0
    flow_start: float | None = None
    flow_end: float | None = None
    last_batch: Any = None
    _open: BatchRecord | None = None
    _in_bare_step: bool = False

    @property
    def attributing(self) -> bool:
        return self.started <= self.attributed

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def start_batch(self, completed: int) -> None:
        """BEFORE_DATALOADER after `completed` batches; at an epoch's end Composer fires it again for the
        same batch (the first fetch ends the epoch), which stays part of that batch."""
        if completed + 1 == self.started:
            return
        self.started = completed + 1
        if self._open is None and not self.attributing:
            return
        now = self.now()
        if self._open is not None:
            self._open.wall_s = now - self._open.start - self._open.bare_step_s
            self.records.append(self._open)
            self._open = None
        if self.attributing:
            self._open = BatchRecord(now)
        else:
            self.flow_start = now

    def fetched(self) -> None:
        if self._open is not None:
            self._open.fetch_s = self.now() - self._open.start

    def add(self, name: str, seconds: float) -> None:
        if self._open is not None:
            self._open.components_s[name] = self._open.components_s.get(name, 0.0) + seconds

    def add_in_step(self, seconds: float) -> None:
        if self._open is not None and not self._in_bare_step:
            self._open.in_step_s += seconds

    def run_bare_step(self, batch: Any) -> None:
        if not self.attributing:
            self.last_batch = batch
            if self.started == self.attributed + self.flow_batches:
                self.flow_end = self.now()
            return
        if self._open is None:
            return
        start = self.now()
        self._in_bare_step = True
        try:
            self.bare_step(batch)
        finally:
            self._in_bare_step = False
        self._open.bare_step_s = self.now() - start


def _batch_clock_callback(clock: BatchClock) -> Any:
    from composer.core import Callback

    class BatchClockCallback(Callback):
        """Last in the callback list, so at BATCH_END the EMA and every other callback have run."""

        def before_dataloader(self, state: Any, logger: Any) -> None:
            clock.start_batch(state.timestamp.batch.value)

        def after_dataloader(self, state: Any, logger: Any) -> None:
            clock.fetched()

        def batch_end(self, state: Any, logger: Any) -> None:
            clock.run_bare_step(state.batch)

    return BatchClockCallback()


def _timed(fn: Callable[..., Any], clock: BatchClock, record: Callable[[float], None]) -> Callable[..., Any]:
    """`fn`, handing its seconds to `record` (functools.wraps keeps the LR scheduler's mark on
    optimizer.step, else it warns)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not clock.attributing:  # the flow batches: nothing waits for the device
            return fn(*args, **kwargs)
        start = clock.now()
        try:
            return fn(*args, **kwargs)
        finally:
            record(clock.now() - start)

    return wrapper


@contextlib.contextmanager
def time_step_work(trainer: Trainer, clock: BatchClock) -> Iterator[None]:
    """Time what the issue calls the step, inside Composer's own batch: the model's forward (the objective's
    draws and the U-Net), its loss, the backward and the optimizer step. Everything else in the batch is
    the Python-side work: data fetch, events, callbacks, EMA, clipping, logging, bookkeeping. The bare step
    (train/bench/step.py) times the same work: zero_grad, forward, loss, backward, step."""
    model, optimizer = trainer.state.model, trainer.state.optimizers[0]
    model.forward = _timed(model.forward, clock, clock.add_in_step)  # type: ignore[method-assign]
    model.loss = _timed(model.loss, clock, clock.add_in_step)  # type: ignore[method-assign]
    optimizer.zero_grad = _timed(optimizer.zero_grad, clock, clock.add_in_step)  # type: ignore[method-assign]
    optimizer.step = _timed(optimizer.step, clock, clock.add_in_step)  # type: ignore[method-assign]
    backward = torch.Tensor.backward
    torch.Tensor.backward = _timed(backward, clock, clock.add_in_step)  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.backward = backward  # type: ignore[method-assign]


def instrument(trainer: Trainer, clock: BatchClock) -> None:
    """Time every algorithm (EMA, gradient clipping) and callback/logger; drop checkpointing.

    Composer saves a checkpoint at the end of any run: for SD2 shapes that is a multi-GB write that a real
    run pays once per save_interval, not per batch, so the bench leaves it out.
    """
    from composer.callbacks import CheckpointSaver

    state = trainer.state
    state.callbacks[:] = [cb for cb in state.callbacks if not isinstance(cb, CheckpointSaver)]
    for algorithm in state.algorithms:
        record = functools.partial(clock.add, type(algorithm).__name__)
        algorithm.apply = _timed(algorithm.apply, clock, record)  # type: ignore[method-assign]
    for callback in state.callbacks:
        time_handlers(callback, functools.partial(clock.add, type(callback).__name__), clock)
    state.callbacks.append(_batch_clock_callback(clock))


def time_handlers(callback: Any, record: Callable[[float], None], clock: BatchClock) -> None:
    """Time the handlers the callback defines, on the instance, so the engine still skips the events it
    does not handle (train/loop/events.py); a callback with its own run_event is timed there."""
    from composer.core import Callback, Event

    from train.loop.events import class_handles

    if type(callback).run_event is not Callback.run_event:
        callback.run_event = _timed(callback.run_event, clock, record)
        return
    for event in Event:
        if class_handles(type(callback), event.value):
            setattr(callback, event.value, _timed(getattr(callback, event.value), clock, record))


def trainer_config(
    recipe: TrainConfig,
    root: Path,
    resolution: int,
    batch_size: int,
    batches: int,
    work: Path,
    setup: DeviceSetup,
    fsdp: bool = False,
) -> TrainConfig:
    """The recipe on the bench dataset: one device, one microbatch per step, no sample grids; `fsdp`:
    wrapped as the recipe wraps it on a cluster (on one rank FSDP runs NO_SHARD: nothing to shard)."""
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
        fsdp=fsdp,
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
    flow_batches: int = 0,
    fsdp: bool = False,
    profile_steps: int = 0,
) -> dict[str, Any]:
    """Composer's wall time per batch (data, EMA, clipping, callbacks, logging included) vs the step work
    inside it, and vs the bare step timed after every batch on the trainer's own model, optimizer and
    batch; then (flow_batches) unsynced batches against as many bare steps back to back; then
    (profile_steps) bare steps under the profiler: ATen ops launched, kernels and the device's busy share, and
    as many counting the Python calls they make, and as many whole Composer batches counted the same way."""
    attributed = warmup + batches
    # then (profile_steps) whole Composer batches counted after the flow batches
    counts = BatchCounts(attributed + flow_batches, profile_steps) if profile_steps else None
    # At least one batch after the attributed ones, and after the counted ones: each of those ends at the
    # next BEFORE_DATALOADER (the flow batches end at their own BATCH_END).
    total = counts.start_after + counts.batches + 1 if counts else attributed + max(flow_batches, 1)
    cfg = trainer_config(recipe, root, resolution, batch_size, total, work, setup, fsdp)
    forget_compiled_code()  # the step section's models compiled in this process too (a run has one)
    trainer = build_trainer(cfg)
    state = trainer.state
    optimizer = state.optimizers[0]

    def bare_step(batch: Any) -> None:
        train_step(state.model, optimizer, unpack(state.device.batch_to_device(batch)), setup)

    clock = BatchClock(setup.sync, bare_step, attributed, flow_batches)
    instrument(trainer, clock)
    with count_readbacks() as reads, time_step_work(trainer, clock):
        trainer.state.callbacks.insert(0, step_tracker(reads))
        if counts is not None:
            trainer.state.callbacks.insert(0, counting_callback(counts))
        try:
            trainer.fit()
            flow = flow_against_bare_steps(clock) if flow_batches else None
            profiled = profile_bare_steps(clock, setup, profile_steps, flow) if profile_steps else None
        finally:
            trainer.close()
    timed_steps = range(warmup + 1, warmup + batches + 1)
    out = summarize_batches(clock.records[warmup:], batch_size)
    out["first_batch_s"] = clock.records[0].wall_s  # start-up: a compiled recipe compiles in it
    out["host_reads_per_step"] = reads_per_step(reads, timed_steps)
    if flow is not None:
        out["flow"] = flow
    if profiled is not None:
        out["profile"] = profiled
    if counts is not None and profiled is not None:  # (both or neither: profile_steps)
        profiled["composer_batch"] = counts.per_batch()  # the same host counts over whole Composer batches
    return out


def profile_bare_steps(
    clock: BatchClock, setup: DeviceSetup, steps: int, flow: dict[str, Any] | None
) -> dict[str, Any]:
    """The bare step on the last batch under the profiler; on a GPU its kernel time over the flow's bare
    step time is how busy the device is (far under 1: the host's launches, not the U-Net, set the pace)."""
    if clock.last_batch is None:
        raise RuntimeError("the trainer bench ran no batch to profile")
    batch = clock.last_batch
    out = profile_calls(lambda _label: clock.bare_step(batch), setup.device.type == "cuda", setup.sync, steps)
    out["python_calls_per_step"] = python_calls(lambda: clock.bare_step(batch), steps)
    setup.sync()
    if flow and (busy := out.get("device_seconds_per_step")):
        out["device_busy_share"] = busy / flow["bare_per_step_s"]
    return out


def flow_against_bare_steps(clock: BatchClock) -> dict[str, Any]:
    """The unsynced batches' wall time each against as many bare steps back to back on the last batch,
    each timed as a whole (one wait for the device at either end)."""
    if clock.flow_start is None or clock.flow_end is None or clock.last_batch is None:
        raise RuntimeError("the trainer bench's flow batches did not all run")
    composer = (clock.flow_end - clock.flow_start) / clock.flow_batches
    start = clock.now()
    for _ in range(clock.flow_batches):
        clock.bare_step(clock.last_batch)
    bare = (clock.now() - start) / clock.flow_batches
    return {
        "batches": clock.flow_batches,
        "composer_per_batch_s": composer,
        "bare_per_step_s": bare,
        "outside_share": max(0.0, 1.0 - bare / composer),
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
    """Medians over the timed batches: Composer's wall time, the step work inside it, the bare step, and
    the parts of the rest."""
    if not records:
        raise ValueError("the trainer bench timed no batch: raise trainer.batches")
    names = sorted({name for r in records for name in r.components_s})
    components = {name: statistics.median(r.components_s.get(name, 0.0) for r in records) for name in names}
    # Composer's own loop: events, batch to device, microbatch bookkeeping, timestamps, scheduler step
    unattributed = statistics.median(
        r.wall_s - r.in_step_s - r.fetch_s - sum(r.components_s.values()) for r in records
    )
    return {
        "batches_timed": len(records),
        "batch_size": batch_size,
        "wall_per_batch_s": statistics.median(r.wall_s for r in records),
        "images_per_s": batch_size / statistics.median(r.wall_s for r in records),
        "in_step_s": statistics.median(r.in_step_s for r in records),
        # median over batches of 1 - step work / wall: the Python-side share of the batch (issue 11)
        "python_side_share": statistics.median(max(0.0, 1.0 - r.in_step_s / r.wall_s) for r in records),
        "bare_step_s": statistics.median(r.bare_step_s for r in records),
        # median over batches of 1 - bare / wall: the same gap measured against a separate bare step, which
        # also counts that step's warmer caches (it runs right after the batch, on the same tensors)
        "outside_step_share": statistics.median(max(0.0, 1.0 - r.bare_step_s / r.wall_s) for r in records),
        "data_fetch_s": statistics.median(r.fetch_s for r in records),
        "components_s": {name: s for name, s in components.items() if s > 0},
        "unattributed_s": unattributed,
    }
