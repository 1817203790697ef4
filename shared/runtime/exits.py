"""How a command ends for the person who typed it: an expected stop prints its message and exits with its
documented code (docs/running-unattended.md, "Exit codes"); anything else is a bug and keeps its traceback.

Expected stops are exceptions whose message already says what happened and what to do: a resumable stop
(exit 75), a finished run, a refused resume, a bad config, a data-contract error (exit 2). `--debug`
anywhere on the command line, or SD_DEBUG=1 in the environment (torchrun hands it to every rank), shows
the traceback of those too.

Each stage's CLI wraps its typer commands once with `guard_commands(app, classify)`, where `classify` maps
an exception to `Stop(code, prefix)` or None (a bug). The wrapper sits inside the command, so typer's test
runner sees the same exit codes as a shell.

`python -m shared.runtime.exits ARGS` is torchrun as the launch supervisor runs it (`torchrun_argv`): torchrun
raises ChildFailedError for any rank that exits non-zero, and Python prints its traceback and a report box,
also when the ranks exited 75 after a clean save or 2 after explaining an error in one line. The supervisor
says what an exit means; here a rank that exited with such a code adds nothing, any other exit one line
(`torchrun: rank 1 exited -9`), and a rendezvous whose store is unreachable or gone (the node hosting it
lost) one line too.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from shared.launch.control import EXIT_FATAL, EXIT_RESUMABLE
from shared.runtime.children import die_with_parent
from shared.runtime.environ import restored_environ

DEBUG_ENV = "SD_DEBUG"
DEBUG_FLAG = "--debug"


@dataclass(frozen=True)
class Stop:
    """How an expected stop ends: its exit code and what goes before its message ("error: " or nothing)."""

    code: int
    prefix: str = "error: "
    quiet: bool = False  # print nothing (another process says it, e.g. global rank 0 for every rank)
    message: str | None = None  # printed instead of the exception's own text


Classify = Callable[[BaseException], Stop | None]

# What the operating system says about a path the user chose (an output folder, a save folder, a data
# path): a setting or a disk to fix, not a bug. FileNotFoundError is each stage's own (it names the path).
PATH_PROBLEMS = {
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "the disk is full: free space or point the path at a larger disk",
    errno.EDQUOT: "the disk quota is used up",
    errno.EACCES: "no permission to write or read there",
    errno.EPERM: "no permission to write or read there",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "it is a folder, where a file was expected",
    errno.EEXIST: "a file is in the way of a folder",
}


def path_problem(err: BaseException) -> Stop | None:
    """An OSError about a path the user gave (read-only, full, not a folder...): one line, exit 2."""
    from shared.storage import StorageError

    if not isinstance(err, OSError) or isinstance(err, StorageError) or err.errno not in PATH_PROBLEMS:
        return None
    return Stop(EXIT_FATAL, message=f"{err} ({PATH_PROBLEMS[err.errno]})")


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def enable_debug() -> None:
    """Tracebacks for everything, in this process and every process it starts (torchrun's ranks)."""
    os.environ[DEBUG_ENV] = "1"


def take_debug_flag(argv: list[str]) -> list[str]:
    """`--debug` anywhere on the command line (`make train ARGS='... --debug'` puts it after the command's
    arguments, where typer would refuse it): switch debug on and return the other arguments."""
    if DEBUG_FLAG not in argv:
        return argv
    enable_debug()
    return [arg for arg in argv if arg != DEBUG_FLAG]


TORCHRUN_RANK_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun in every process it starts


def main(app: typer.Typer, prog_name: str) -> Any:
    """Run a stage's typer app as `python -m <stage>` does: `--debug` taken from anywhere first. A rank that
    torchrun started ends with it: torchrun killed (with -9, or with the supervisor it dies with) left its
    ranks training on, parented to init."""
    if TORCHRUN_RANK_ENV in os.environ:
        die_with_parent()
    sys.argv[1:] = take_debug_flag(sys.argv[1:])
    return app(prog_name=prog_name)


def add_debug_option(app: typer.Typer) -> None:
    """`python -m train --debug fit ...` (listed in --help); `take_debug_flag` also finds it elsewhere."""

    @app.callback()
    def _options(
        debug: bool = typer.Option(
            False, DEBUG_FLAG, help=f"show tracebacks for expected stops too (or set {DEBUG_ENV}=1)"
        ),
    ) -> None:
        if debug:
            enable_debug()


def guard_commands(app: typer.Typer, classify: Classify) -> None:
    """Wrap every command registered on `app` so that an expected stop ends as `classify` says."""
    for info in app.registered_commands:
        if info.callback is not None and not getattr(info.callback, "_guarded", False):
            info.callback = _guarded(info.callback, classify)


def _guarded(command: Callable[..., Any], classify: Classify) -> Callable[..., Any]:
    @functools.wraps(command)  # typer reads the parameters through __wrapped__
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except Exception as err:
            stop = None if isinstance(err, typer.Exit) else classify(err)
            if stop is None or debug_enabled():
                raise
            if not stop.quiet:
                typer.echo(f"{stop.prefix}{stop.message or err}", err=True)
            raise typer.Exit(stop.code) from None

    run._guarded = True  # type: ignore[attr-defined]
    return run


# ------------------------------------------------------------------------------------------- torchrun
SELF_EXPLAINED = (EXIT_RESUMABLE, EXIT_FATAL)  # exit codes whose rank printed why it stopped
# torch's per-rank "failed (exitcode: N)" and "Sending process N closing signal" lines; the line below says it
ELASTIC_API_LOGGER = "torch.distributed.elastic.multiprocessing.api"
TORCHRUN_FAILED = 1  # torchrun's own exit code when a rank failed
# Ours when the rendezvous failed (its store unreachable or gone): the supervisor then says so, not that the
# restarts were spent or a lost node never came back.
RENDEZVOUS_FAILED = 3
TORCHELASTIC_TEMP_PREFIX = "torchelastic_"
CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"


def torchrun_argv(argv: list[str]) -> list[str]:
    """`torchrun ARGS` -> `python -m shared.runtime.exits ARGS` (this interpreter); other commands as is."""
    if argv and os.path.basename(argv[0]) == "torchrun":
        return [sys.executable, "-m", "shared.runtime.exits", *argv[1:]]
    return list(argv)


def run_torchrun() -> None:
    """torchrun's main without the traceback box for ranks that stopped on purpose (module doc)."""
    import logging

    die_with_parent()  # the supervisor, in whose own session it runs: a kill -9 of it left torchrun running

    # The agent's own C++ log (c10d's store client: every connect retry with its C++ stack) stays quiet
    # unless debugging; it is read once, when torch loads, so the ranks torchrun starts keep the caller's.
    with restored_environ((CPP_LOG_ENV,)):
        if not debug_enabled():
            os.environ.setdefault(CPP_LOG_ENV, "FATAL")
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import RendezvousError
        from torch.distributed.run import main as torchrun_main

    if not debug_enabled():
        logging.getLogger(ELASTIC_API_LOGGER).setLevel(logging.CRITICAL)
    with _removing_new_temp_dirs(TORCHELASTIC_TEMP_PREFIX):
        try:
            _torchrun_quietly(torchrun_main, ChildFailedError, RendezvousError)
        except SignalException as err:  # Ctrl-C / SIGTERM to torchrun: it stopped its ranks; a line, 128+N
            if debug_enabled():
                raise
            print(f"torchrun: stopped by {err.sigval.name}", file=sys.stderr, flush=True)
            sys.exit(128 + int(err.sigval))


@contextlib.contextmanager
def _removing_new_temp_dirs(prefix: str) -> Iterator[None]:
    """torchrun leaves its per-launch log folder (<tmp>/torchelastic_*) behind: one per launch and restart."""
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob(f"{prefix}*"))
    try:
        yield
    finally:
        for folder in set(temp.glob(f"{prefix}*")) - before:
            shutil.rmtree(folder, ignore_errors=True)


def _torchrun_quietly(
    torchrun_main: Callable[[], Any], failed: type[Exception], rendezvous: type[Exception]
) -> None:
    try:
        torchrun_main()
    except rendezvous as err:  # the store unreachable or gone: a node lost (node 0 hosts it), not a bug here
        if debug_enabled():
            raise
        cause = f" ({err.__cause__})" if err.__cause__ else ""
        print(f"torchrun: the rendezvous failed: {err}{cause}", file=sys.stderr, flush=True)
        sys.exit(RENDEZVOUS_FAILED)
    except failed as err:
        if debug_enabled():
            raise
        # failures: global rank -> ProcessFailure (which has local_rank, pid and exitcode, not the rank)
        failures = sorted(err.failures.items())  # type: ignore[attr-defined]
        unexplained = [(rank, f.exitcode) for rank, f in failures if f.exitcode not in SELF_EXPLAINED]
        if unexplained:
            text = ", ".join(f"rank {rank} exited {code}" for rank, code in unexplained)
            print(f"torchrun: {text}", file=sys.stderr, flush=True)
        sys.exit(TORCHRUN_FAILED)


if __name__ == "__main__":
    run_torchrun()


def rendezvous_endpoint(argv: Sequence[str]) -> str:
    """torchrun's `--rdzv-endpoint` in `argv` ("its endpoint" when there is none)."""
    flag = "--rdzv-endpoint="
    return next((word[len(flag) :] for word in argv if word.startswith(flag)), "its endpoint")
