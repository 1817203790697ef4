"""Composer's event dispatch without the calls that do nothing.

Composer's Engine calls every callback and logger on every event (~13 events a batch, ~15 callbacks here),
formatting a debug line for each call, and most calls land on `Callback`'s empty default handler. On the
tiny CPU bench that was ~39 us an event. `LeanEngine` calls a callback only for the events it handles (its
class or the instance defines the handler, or overrides `run_event`), in the same order, and formats no
debug lines; for events after INIT it also skips the checks that only Composer's profiler and its asserts
use (`LeanEngine.run_event`). With Composer's profiler on, or ENGINE_DEBUG set when the trainer starts,
Composer's own dispatch runs (its per-callback markers and debug lines).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

from composer.core import Callback, Engine, Event

ENGINE_DEBUG = "ENGINE_DEBUG"  # Composer's switch for its engine's per-callback debug lines


# id(class) -> the events its instances handle, dropped when the class goes: a class made per call (a
# callback defined in a function, closing over that call's objects) must not be kept alive by the cache, nor
# what it closes over (under functools.cache the bench's per-run clock callback held each finished trainer's
# whole State). Keyed by id for a plain dict lookup: it runs for every callback on every event.
_HANDLED: dict[int, frozenset[str]] = {}


def class_handles(cls: type, event_name: str) -> bool:
    """Instances of `cls` do something on this event: the class defines its handler or its own run_event."""
    handled = _HANDLED.get(id(cls))
    if handled is None:
        handled = _HANDLED[id(cls)] = frozenset(e.value for e in Event if _defines_handler(cls, e.value))
        weakref.finalize(cls, _HANDLED.pop, id(cls), None)
    return event_name in handled


def _defines_handler(cls: type, event_name: str) -> bool:
    if cls.run_event is not Callback.run_event:  # type: ignore[attr-defined]
        return True
    return getattr(cls, event_name, None) is not getattr(Callback, event_name)


def _as_event(event: Event | str) -> Event:
    return event if type(event) is Event else Event(event)  # Event(member) is three Python calls


def handles(callback: Any, event: Event) -> bool:
    """Composer's call for this event would run code other than Callback's empty default."""
    own = getattr(callback, "__dict__", {})  # handlers set on the instance (wrappers, tests)
    return class_handles(type(callback), event.value) or "run_event" in own or event.value in own


class LeanEngine(Engine):
    """Composer's Engine, calling only the callbacks that handle each event (see module doc)."""

    def run_event(self, event: Event | str) -> Any:
        """Composer's `run_event` for every event after INIT, without the two things that only cost: its
        profiler markers' checks (`is_before_event` / `is_after_event`: list lookups by Python string
        compares, for a profiler that is off) and its asserts that the trainer set a dataloader and a
        duration (the Trainer sets both before any event past INIT). ~750 Python calls a batch."""
        event = _as_event(event)
        if self.state.profiler is not None or self._is_closed or event is Event.INIT:
            return super().run_event(event)
        traces = self._run_algorithms(event)
        self._run_nonlogger_callbacks(event)  # callbacks before loggers, as Composer orders them
        self._run_loggers(event)
        return traces

    def _run_callbacks(self, event: Event | str, callbacks: Sequence[Callback] | None = None) -> None:
        if self.state.profiler is not None:
            super()._run_callbacks(event, callbacks)
            return
        event = _as_event(event)
        for callback in self.state.callbacks if callbacks is None else callbacks:
            if handles(callback, event):
                callback.run_event(event, self.state, self.logger)

    def _debug_log(self, event: Event, msg: str) -> None:
        return None


def make_lean(engine: Engine) -> None:
    """Switch a trainer's engine to LeanEngine, unless ENGINE_DEBUG asks for Composer's debug lines."""
    if not os.environ.get(ENGINE_DEBUG):
        engine.__class__ = LeanEngine
