"""Issue 33: a process that ran a training in-process still ends on SIGTERM (and stops on Ctrl-C) afterwards.

Before, SIGTERM and SIGUSR1 stayed bound to the finished run's `ResilienceMonitor._on_signal` and SIGINT to
Composer's import-time `sys.exit` handler, so `timeout pytest ...` could not end a GPU test run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.train.conftest import REPO_ROOT
from train.resilience.monitor import STOP_SIGNALS, ResilienceMonitor
from train.resilience.signals import RUN_SIGNALS, restored_signal_handlers, restores_signal_handlers

END_WITHIN_S = 20


def mine(signum: int, frame: object) -> None:  # a caller's own handler
    pass


def test_the_callers_handlers_are_back_after_the_block_returns_or_raises() -> None:
    before = {sig: signal.getsignal(sig) for sig in RUN_SIGNALS}
    try:
        for sig in RUN_SIGNALS:
            signal.signal(sig, mine)
        with pytest.raises(RuntimeError), restored_signal_handlers():
            for sig in RUN_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            raise RuntimeError("a failed run")
        assert all(signal.getsignal(sig) is mine for sig in RUN_SIGNALS)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_composers_import_time_handlers_give_way_to_pythons_defaults() -> None:
    import composer.core.engine as engine  # binds SIGTERM and SIGINT to sys.exit at import

    before = {sig: signal.getsignal(sig) for sig in RUN_SIGNALS}
    try:
        signal.signal(signal.SIGTERM, engine.sigterm_handler)
        signal.signal(signal.SIGINT, engine.sigterm_handler)
        restores_signal_handlers(lambda: None)()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_the_monitor_puts_back_what_it_replaced_when_the_trainer_closes() -> None:
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        signal.signal(signal.SIGTERM, mine)
        monitor = ResilienceMonitor("10ba", None, 60.0)
        monitor.fit_start(None, None)  # type: ignore[arg-type]  (neither is read)
        assert signal.getsignal(signal.SIGTERM) == monitor._on_signal
        monitor.close(None, None)  # type: ignore[arg-type]
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


CHILD = """
import signal, sys, time
from tests.train.conftest import tiny_config
from train.loop.trainer import fit
fit(tiny_config({data!r}, {save!r}, {cache!r}, "max_duration=2ba", "samples.enabled=false"))
print("fit returned", signal.getsignal(signal.SIGTERM), flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_a_process_that_ran_fit_in_process_ends_on_sigterm(
    tiny_dataset: str, tmp_path: Path, killed_temp: Path
) -> None:
    script = CHILD.format(data=tiny_dataset, save=str(tmp_path / "save"), cache=str(tmp_path / "cache"))
    env = {**os.environ, "TMPDIR": str(killed_temp)}  # ended by the signal's default action: no cleanup
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO_ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        lines = []
        for line in child.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("fit returned"):
                break
        assert lines and lines[-1].startswith("fit returned"), "".join(lines[-40:])
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=END_WITHIN_S) == -signal.SIGTERM  # the OS default: ended by the signal
        assert time.monotonic() - sent < END_WITHIN_S
    finally:
        child.kill()
        child.wait()


def test_a_stop_at_the_last_batch_of_a_run_in_epochs_ends_it_done(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At BATCH_CHECKPOINT the epoch counter has not moved yet: a stop on the last batch of the last epoch
    raised a resumable stop (exit 75, a requeue) for a run with nothing left to train."""
    from shared.launch import control
    from tests.train.conftest import tiny_config
    from train.loop.trainer import fit

    folder = tmp_path / "control"  # as under the supervisor, asked to stop before the first step
    folder.mkdir()
    control.request_stop(folder, "SIGTERM")
    monkeypatch.setenv(control.CONTROL_DIR_ENV, str(folder))
    cfg = tiny_config(
        tiny_dataset, tmp_path / "save", tmp_path / "cache", "max_duration=1ep", "global_batch_size=64",
        "device_microbatch_size=32", "samples.enabled=false",
    )  # fmt: skip
    trainer = fit(cfg)  # one batch an epoch: the stop lands on the run's last batch
    assert (int(trainer.state.timestamp.epoch), int(trainer.state.timestamp.batch)) == (1, 1)


class FailingTrainer:
    """What fit() builds, binding SIGTERM as the monitor does and failing mid-run."""

    def fit(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise RuntimeError("a rank failed")

    def close(self) -> None:
        pass


def test_fit_gives_the_handlers_back_when_the_run_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import train.loop.trainer as trainer

    monkeypatch.setattr(trainer, "build_trainer", lambda cfg: FailingTrainer())
    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, mine)
        with pytest.raises(RuntimeError, match="a rank failed"):
            trainer.fit(None)  # type: ignore[arg-type]
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_to_every_process_of_a_rank_with_loader_workers_saves_the_step_and_exits_resumable(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Slurm signals every process of a job step at a preemption, a scancel or the time limit: the loader
    workers (8 a rank in the shipped recipes) died of that SIGTERM and the rank's next batch failed
    ("DataLoader worker ... is killed by signal: Terminated"), exit 1 with a traceback, the step unsaved."""
    from tests.leftovers import processes_naming
    from tests.train.conftest import run_train_cli, tiny_overrides

    save, temp = tmp_path / "save", tmp_path / "tmp"
    temp.mkdir()
    overrides = tiny_overrides(
        tiny_dataset, save, tmp_path / "cache", "max_duration=400ba", "save_interval=4ba",
        "samples.enabled=false", "data.num_workers=2",
    )  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    rank = run_train_cli(["fit", "tiny", *overrides], temp, start_new_session=True, **pipes)
    try:
        deadline = time.monotonic() + 240
        while not (save / "latest-rank0.pt").exists():
            assert rank.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        os.killpg(rank.pid, signal.SIGTERM)  # the rank and its loader workers, as slurmstepd does
        out, _ = rank.communicate(timeout=120)
    finally:
        rank.kill()
    assert rank.returncode == 75, out[-4000:]
    assert "Traceback" not in out and "killed by signal" not in out, out[-4000:]
    assert "on SIGTERM after saving a checkpoint of it" in out.splitlines()[-1], out[-2000:]
    assert processes_naming(temp.resolve()) == []
    assert sorted(p.name for p in temp.glob("*_filelock")) == []  # its workers ended before it removed them
