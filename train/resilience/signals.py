"""A process that ran a training in-process (a test, a notebook, a sweep driver, `make test-gpu`) must still
end on SIGTERM and stop on Ctrl-C afterwards.

Two things bind the signals during a run: `ResilienceMonitor.fit_start` (SIGTERM and SIGUSR1 only set a flag),
and Composer itself, at import (`composer/core/engine.py` binds SIGTERM and SIGINT to `sys.exit(128 + sig)`:
inside pytest that fails the running test instead of ending the session, so `timeout pytest ...` could not
stop a GPU run). `restores_signal_handlers` puts back what the caller had, and Python's defaults where that
was Composer's import-time handler.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

# Every signal a run binds: the monitor's two stop signals, and Composer's SIGINT.
RUN_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
COMPOSER_HANDLER_MODULE = "composer.core.engine"

F = TypeVar("F", bound=Callable[..., Any])


def python_default(sig: signal.Signals) -> Any:
    """What a fresh Python process has: KeyboardInterrupt on SIGINT, the OS default for the others."""
    return signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL


def caller_handler(sig: signal.Signals, handler: Any) -> Any:
    """The handler to put back: the caller's own, or Python's default for Composer's import-time one."""
    if getattr(handler, "__module__", None) == COMPOSER_HANDLER_MODULE:
        return python_default(sig)
    return python_default(sig) if handler is None else handler  # None: installed outside Python


def restore(saved: dict[signal.Signals, Any]) -> None:
    for sig, handler in saved.items():
        signal.signal(sig, caller_handler(sig, handler))


@contextlib.contextmanager
def restored_signal_handlers(signals: tuple[signal.Signals, ...] = RUN_SIGNALS) -> Iterator[None]:
    """The block may bind `signals`; when it returns or raises they are the caller's again."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread can bind them
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        restore(saved)


def restores_signal_handlers(func: F) -> F:
    """Decorator form of `restored_signal_handlers`, for in-process entry points (`fit`, `run_bench`)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with restored_signal_handlers():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
