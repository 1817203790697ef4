"""LeanEngine calls exactly the handlers Composer's Engine would run code in, in the same order, and skips
the calls that would land on Callback's empty defaults."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from composer.core import Algorithm, Callback, Engine, Event

from train.loop.events import LeanEngine, handles


class Recorder(Callback):
    """Records its batch_end and fit_end calls into a shared list."""

    def __init__(self, name: str, calls: list[tuple[str, str]]):
        self.name, self.calls = name, calls

    def batch_end(self, state: Any, logger: Any) -> None:
        self.calls.append((self.name, "batch_end"))

    def fit_end(self, state: Any, logger: Any) -> None:
        self.calls.append((self.name, "fit_end"))


class OwnDispatch(Callback):
    """Overrides run_event itself: gets every event, as under Composer."""

    def __init__(self, calls: list[tuple[str, str]]):
        self.calls = calls

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        self.calls.append(("own", event.value))


class Silent(Callback):
    """Handles nothing."""


def callbacks(calls: list[tuple[str, str]]) -> list[Callback]:
    wrapped = Silent()
    wrapped.before_forward = lambda state, logger: calls.append(("wrapped", "before_forward"))  # type: ignore[method-assign]
    return [Recorder("a", calls), Silent(), OwnDispatch(calls), wrapped, Recorder("b", calls)]


def dispatch(engine_class: type[Engine]) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []
    engine = object.__new__(engine_class)  # the dispatch alone: no trainer state behind it
    engine.state = SimpleNamespace(profiler=None, callbacks=callbacks(calls))  # type: ignore[assignment]
    engine.logger = None  # type: ignore[assignment]
    engine._debug_log = lambda event, msg: None  # type: ignore[method-assign]
    engine._is_closed = True  # nothing to close at garbage collection
    for event in Event:
        engine._run_callbacks(event)
    return calls


def test_lean_dispatch_makes_the_same_calls_in_the_same_order() -> None:
    composer, lean = dispatch(Engine), dispatch(LeanEngine)
    assert lean == composer
    assert ("wrapped", "before_forward") in lean and ("b", "fit_end") in lean
    assert [c for c in lean if c[0] == "own"] == [("own", event.value) for event in Event]


def test_handles_only_what_the_class_or_instance_defines() -> None:
    calls: list[tuple[str, str]] = []
    recorder, silent, own, wrapped, _ = callbacks(calls)
    assert handles(recorder, Event.BATCH_END) and not handles(recorder, Event.BEFORE_FORWARD)
    assert not any(handles(silent, event) for event in Event)
    assert all(handles(own, event) for event in Event)
    assert handles(wrapped, Event.BEFORE_FORWARD) and not handles(wrapped, Event.AFTER_FORWARD)


class Recording(Algorithm):
    """Runs on two events, recording its calls into the shared list."""

    def __init__(self, calls: list[tuple[str, str]]):
        self.calls = calls

    def match(self, event: Event, state: Any) -> bool:
        return event in (Event.AFTER_TRAIN_BATCH, Event.BATCH_END)

    def apply(self, event: Event, state: Any, logger: Any) -> None:
        self.calls.append(("algorithm", event.value))


def run_events(engine_class: type[Engine]) -> tuple[list[tuple[str, str]], list[list[str]]]:
    """Every event after INIT through `run_event`: the calls made and each event's trace names."""
    calls: list[tuple[str, str]] = []
    engine = object.__new__(engine_class)
    engine.state = SimpleNamespace(  # type: ignore[assignment]
        profiler=None,
        callbacks=callbacks(calls),
        algorithms=[Recording(calls)],
        dataloader=[],
        max_duration=1,
    )
    engine.logger = SimpleNamespace(log_traces=lambda traces: calls.append(("traces", ",".join(traces))))  # type: ignore[assignment]
    engine.algorithm_passes = []
    engine._debug_log = lambda event, msg: None  # type: ignore[method-assign]
    engine._is_closed = False
    try:
        traces = [
            [trace.name for trace in engine.run_event(e).values()] for e in Event if e is not Event.INIT
        ]
    finally:
        engine._is_closed = True
    return calls, traces


def test_lean_run_event_runs_the_same_algorithms_callbacks_and_traces() -> None:
    """LeanEngine.run_event skips the profiler's marker checks and the dataloader / duration asserts: the
    algorithms, callbacks and trace logging stay Composer's, in Composer's order."""
    composer, lean = run_events(Engine), run_events(LeanEngine)
    assert lean == composer
    assert ("algorithm", "batch_end") in lean[0] and ("b", "batch_end") in lean[0]
    assert sum(call[0] == "traces" for call in lean[0]) == 2 and ["Recording"] in lean[1]
