"""Where an encode rank's time goes: its main thread's phases, and how busy the device was.

The two answer different questions. The main thread's phases say what the host did; the device timeline says
whether the device waited for it. At the pipeline's bound on a GPU the device is busy all the time it is fed
(the models are the slowest stage) or the main thread waits for the workers (decoding is); a device idle
between batches while the main thread is busy launching means host work is the bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class DeviceTimeline:
    """Marks queued on the device's stream around each model call, read once the call's results are in.

    A call's span (its first mark to its second) is the device's time on it, counted as busy; from one
    span's end to the next one's start the device had nothing queued: idle, waiting for the host. On CUDA
    the marks are timing events (no wait for the device to place them: they run in stream order); elsewhere
    the models run inside the call, and the marks are the host's clock.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._last_end: Any = None

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start

    def account(self, spans: Sequence[tuple[Any, Any]]) -> None:
        """Count spans whose results the host has received (so their marks have run on the device), in the
        order they were launched."""
        for start, end in spans:
            if self.cuda:
                end.synchronize()  # placed right after the call's copies, which the host has waited for
            if self._last_end is not None:
                self.idle_s += max(0.0, self._seconds(self._last_end, start))
            self.busy_s += self._seconds(start, end)
            self._last_end = end

    def seconds(self) -> dict[str, float]:
        return {"busy": self.busy_s, "idle": self.idle_s}


class MainThreadTimes:
    """Where the main thread's seconds go, by phase: `waiting_for_workers` (the next batch not prepared
    yet), `launch` (queueing the models), `waiting_for_device` (results not there yet), `writing` (rows into
    MDS) and `publishing` (closing a partition's shards, handing it to the uploader). On a GPU a pipeline at
    its bound spends its time waiting for the slowest stage; anything else is host work the device waited
    for. `device` is the device's side of the same run."""

    PHASES = ("waiting_for_workers", "launch", "waiting_for_device", "writing", "publishing")
    # `launch` taken apart: the text tower's call, stacking a batch's images into one (pinned) host tensor,
    # and the VAE's call (the copy to the device and the encoder's kernels queued)
    LAUNCH_PARTS = ("text", "pixel_batch", "vae")

    def __init__(self, device: torch.device) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.launch_parts = dict.fromkeys(self.LAUNCH_PARTS, 0.0)
        self.device = DeviceTimeline(device)

    def phase(self, name: str) -> AbstractContextManager[None]:
        return _adding_seconds(self.seconds, name)

    def launch_part(self, name: str) -> AbstractContextManager[None]:
        return _adding_seconds(self.launch_parts, name)

    @contextmanager
    def on_device(self, spans: list[tuple[Any, Any]]) -> Iterator[None]:
        """Around a call that queues device work: its span goes into `spans` (DeviceTimeline.account)."""
        start = self.device.mark()
        yield
        spans.append((start, self.device.mark()))

    def items(self, iterable: Iterable[T]) -> Iterator[T]:
        it = iter(iterable)
        while True:
            with self.phase("waiting_for_workers"):
                item = next(it, None)
            if item is None:
                return
            yield item


@contextmanager
def _adding_seconds(into: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        into[name] += time.perf_counter() - start
