"""A supervising launch process: runs torchrun, restarts it after a crash or a hang, stops it with a save.

`python -m train launch` used to replace itself with torchrun, so a SIGTERM reached torchrun, which forwards
it, SIGKILLs the ranks 30 s later and exits 1 even after a clean save; SIGUSR1 killed torchrun and orphaned
the ranks. Now the launch process stays, as the parent of torchrun (in a session of its own, so a terminal's
Ctrl-C or a TERM to the launch's process group reaches only this process):
- SIGTERM / SIGUSR1 / SIGINT: writes the control folder's `stop` file; the ranks agree on it at the next step
  boundary, save and exit, and the supervisor exits EXIT_RESUMABLE. A second signal kills the ranks.
- a rank dies (kill -9, OOM, a lost GPU): torchrun fails; the whole node restarts from the last checkpoint,
  up to `max_restarts` times.
- a rank completes no step for `hang_timeout_s` (its heartbeat goes stale), or still runs that long after
  its trainer closed: every rank's Python stack is logged (py-spy reads a stopped process from outside),
  every process of the attempt is SIGKILLed, and the node restarts as after a crash.
- an S3 outage (a rank records `outage`): a restart not counted as a crash, once a step; the restarted ranks
  wait for S3 before they read anything (train/resilience/outage.py).
- an error no restart fixes (rank 0 records it as `fatal`), or a failure at the same step as the previous
  one: stop at once with its message and the checkpoint a rerun resumes from.
Several nodes (`elastic`): torchrun's elastic agent restarts the ranks, every node's together
(`--max-restarts`, a `c10d` rendezvous), so the supervisor never restarts torchrun; it watches. New
processes writing the heartbeats while the previous ones are gone are a restart (logged; two from the
same step are a crash loop: it stops torchrun, which ends the rendezvous for every node); a hang SIGKILLs
this node's ranks (not torchrun), so the agents restart every node; signals and deadlines work as above.
The files it shares with the ranks are described in shared/launch/control.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.launch import control
from shared.launch.ranks import (
    Generations,
    alive,
    descendants,
    forget_shm,
    kill_all,
    kill_ranks_first,
    mapped_shm,
    orphan_semaphores,
    stacks_report,
    strays,
    unmapped_shm,
    wait_exited,
)
from shared.runtime.exits import RENDEZVOUS_FAILED, rendezvous_endpoint, torchrun_argv
from shared.storage.safety import NODE_TMPDIR_ENV

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# How long the surviving nodes' agents wait in a new rendezvous round for a lost node's replacement before
# torchrun stops (torchrun's own join_timeout default, passed explicitly so the plan and the docs name it).
REJOIN_TIMEOUT_S = 600
# torch 2.7's c10d rendezvous hands the ranks of every round the TCPStore of its first round by default:
# keys of the dead generation stay in it (gloo's connectFullMesh then dials dead ranks: 4 failed restarts
# in a row in the two-node test), and it dies with the node that hosted it. With this set, rank 0 of each
# new round hosts a fresh store.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True)
class Supervision:
    """How a launch is supervised (from the train config's `resilience` section)."""

    max_restarts: int = 3
    hang_timeout_s: float = 600.0
    max_wall_time_s: float | None = None  # from this launch's start; None: no limit of its own
    # Seconds before a scheduler's end time by which the ranks must have saved (Slurm: from EndTime).
    deadline_lead_s: float = 120.0
    poll_s: float = 0.5
    # Several nodes: torchrun's elastic agent restarts the ranks (module doc); the supervisor only watches.
    elastic: bool = False

    def flags(self) -> list[str]:
        """The same settings as `python -m shared.launch.supervise` flags (sbatch scripts, pod commands)."""
        out = [f"--max-restarts={self.max_restarts}", f"--hang-timeout-s={self.hang_timeout_s:g}"]
        out.append(f"--deadline-lead-s={self.deadline_lead_s:g}")
        if self.max_wall_time_s is not None:
            out.append(f"--max-wall-time-s={self.max_wall_time_s:g}")
        if self.elastic:
            out.append("--elastic")
        return out


@dataclass(frozen=True)
class Outcome:
    """How one torchrun attempt ended."""

    # done | resumable | fatal | finished (the run had reached max_duration) | outage | crash | hang
    kind: str
    batch: int  # the highest step any rank completed (-1: none)
    detail: str = ""


class Supervisor:
    """Runs `argv` (torchrun ...) until it finishes, stops on request, or gives up (see module doc)."""

    def __init__(
        self,
        argv: Sequence[str],
        supervision: Supervision,
        env: Mapping[str, str] | None = None,
        log: Callable[[str], None] | None = None,
        deadline: float | None = None,
    ):
        self.argv = list(argv)
        self.supervision = supervision
        self.env = dict(os.environ if env is None else env)
        self.log = log or (lambda text: print(f"supervisor: {text}", file=sys.stderr, flush=True))
        # Node-local ($TMPDIR): heartbeats are rewritten every step and must not load a shared filesystem.
        removed = control.remove_dead_control_folders(Path(tempfile.gettempdir()))
        self.folder = Path(tempfile.mkdtemp(prefix=control.CONTROL_PREFIX))
        control.write_owner(self.folder)
        self.deadline = deadline
        if supervision.max_wall_time_s is not None:
            own = time.time() + supervision.max_wall_time_s - supervision.deadline_lead_s
            self.deadline = own if deadline is None else min(deadline, own)
        self.stop_reason: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.shm: set[str] = set()  # /dev/shm files the run's processes mapped (ranks.mapped_shm)
        self.started = time.time()  # semaphores no process maps, created since then, are the run's orphans
        if removed:
            self.log(f"removed {removed} control folder(s) of supervisors that are gone (a node lost whole)")

    # ------------------------------------------------------------------------------------------ signals
    def on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.stop_reason is None:
            self.stop_reason = name
            self.log(f"{name}: asking every rank to save at the next step boundary and exit")
            control.request_stop(self.folder, name)
            return
        self.log(f"second signal ({name}): killing the ranks without a save")
        if self.proc is not None:
            kill_all([*descendants(self.proc.pid), self.proc.pid])

    # ------------------------------------------------------------------------------------------ the run
    def run(self) -> int:
        previous = {sig: signal.signal(sig, self.on_signal) for sig in STOP_SIGNALS}
        try:
            return self._watch_elastic() if self.supervision.elastic else self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.end_strays(keep=[os.getpid()])
            shutil.rmtree(self.folder, ignore_errors=True)
            self.forget_shm()

    def end_strays(self, keep: list[int]) -> None:
        """SIGKILL what killed ranks left running outside the launch's process tree (ranks.strays)."""
        found = strays(self.folder, keep)
        if found:
            kill_all(found)
            wait_exited(found)  # before a /dev/shm sweep: a dying process still maps what it used
            self.log(f"ended {len(found)} process(es) killed ranks had left running (pids {found})")

    def watch_shm(self) -> None:
        assert self.proc is not None
        self.shm |= mapped_shm(descendants(self.proc.pid))

    def forget_shm(self) -> None:
        """Unlink what the run's processes mapped in /dev/shm and no live process maps any more."""
        # The candidates first, then what is mapped, by inode (ranks.unmapped_shm): a semaphore another job
        # of this user creates during the run or the sweep stays. Before, its creator's mapping went
        # unrecognised and it was unlinked under a live job (whose workers open it by name), as seen when
        # two test workers ran side by side.
        removed = forget_shm(unmapped_shm(self.shm | orphan_semaphores(self.started)))
        if removed:
            self.log(f"removed {removed} file(s) the ranks left in /dev/shm (killed before they could)")

    def _loop(self) -> int:
        restarts, last_failure, last_outage = 0, None, None
        while True:
            outcome = self.attempt()
            self.end_strays(keep=[os.getpid()])  # torchrun has exited: nothing of this attempt may stay
            code = self.final_code(outcome, restarted=restarts > 0)
            if code is not None:
                return code
            where = self.resume_point()
            if outcome.kind == "outage" and outcome.batch != last_outage:  # a second at one step counts
                last_outage = outcome.batch  # the restarted ranks wait for S3 before they read anything
                self.log(
                    f"S3 outage at step {outcome.batch} ({outcome.detail}): restarting from {where}; the "
                    "ranks wait for S3 before they read anything (not counted as a crash)"
                )
                continue
            if last_failure is not None and outcome.batch == last_failure:
                self.log(
                    f"{outcome.kind} again at step {outcome.batch}, as before the last restart: a restart "
                    f"will not fix it; stopping ({outcome.detail}). A rerun resumes from {where}"
                )
                return control.EXIT_GAVE_UP
            if restarts >= self.supervision.max_restarts:
                self.log(
                    f"{outcome.kind} at step {outcome.batch} after {restarts} restart(s), the budget "
                    f"(resilience.max_restarts={self.supervision.max_restarts}); stopping. A rerun resumes "
                    f"from {where}"
                )
                return control.EXIT_GAVE_UP
            restarts, last_failure = restarts + 1, outcome.batch
            self.log(
                f"{outcome.kind} at step {outcome.batch} ({outcome.detail}): restart "
                f"{restarts}/{self.supervision.max_restarts} from {where}"
            )

    # ------------------------------------------------------------------ several nodes: torchrun restarts
    def _watch_elastic(self) -> int:
        """One torchrun for the whole launch; its agent restarts every node's ranks (module doc)."""
        control.clear_attempt(self.folder)
        self.proc = subprocess.Popen(torchrun_argv(self.argv), env=self.attempt_env(), start_new_session=True)
        gens = Generations()
        while self.proc.poll() is None:
            time.sleep(self.supervision.poll_s)
            self.watch_shm()
            code = self.elastic_poll(gens)
            if code is not None:  # stopping torchrun ends the rendezvous, so every node stops
                kill_all([*descendants(self.proc.pid), self.proc.pid])
                self.proc.wait()
                return code
        outcome = self.classify(self.proc.returncode, gens.batch)
        code = self.final_code(outcome, restarted=gens.restarts > 0)
        if code is not None:
            return code
        if self.proc.returncode == RENDEZVOUS_FAILED:
            why = (
                f"this node could not reach the rendezvous store ({rendezvous_endpoint(self.argv)}, node 0's "
                "agent: it is gone or not started yet, or its address does not reach it from here; "
                "torchrun's line above says which)"
            )
        else:
            why = (
                f"its restarts (resilience.max_restarts={self.supervision.max_restarts}) are spent, or a "
                f"lost node was not replaced within {REJOIN_TIMEOUT_S} s"
            )
        self.log(
            f"torchrun stopped at step {outcome.batch} after {gens.restarts} restart(s) ({outcome.detail}): "
            f"{why}. A rerun resumes from {self.resume_point()}"
        )
        return control.EXIT_GAVE_UP

    def elastic_poll(self, gens: Generations) -> int | None:
        """One look at the ranks: an exit code to stop with, or None to keep watching."""
        record = control.read_json(self.folder / control.EXIT_FILE) or {}
        if record.get("state") in ("fatal", "finished"):
            outcome = Outcome(record["state"], int(record.get("batch", -1)), str(record.get("message", "")))
            return self.final_code(outcome, restarted=gens.restarts > 0)
        beats = control.read_heartbeats(self.folder)
        ended = gens.observe(beats, alive)
        if ended is not None:
            self.void_old_record(beats, gens)
            self.end_strays(keep=[os.getpid(), *descendants(os.getpid())])  # the new generation stays
            where = self.resume_point()
            if not gens.restarted(ended):
                self.log(
                    f"{gens.cause} again at step {ended}, as before the last restart: a restart will not fix "
                    f"it; stopping every node. A rerun resumes from {where}"
                )
                return control.EXIT_GAVE_UP
            self.log(
                f"{gens.cause} at step {ended}: torchrun restarted every node's ranks, restart "
                f"{gens.restarts}/{self.supervision.max_restarts} from {where}"
            )
            gens.cause = "crash"
        hung = gens.hung(beats, alive, time.time(), self.supervision.hang_timeout_s)
        if hung:  # kill this node's ranks, not torchrun: its agent then restarts every node's ranks
            self.log_stacks(hung, {beat.pid: beat.rank for beat in beats if beat.pid in gens.pids})
            assert self.proc is not None
            kill_ranks_first(self.proc.pid)
            gens.cause = "hang"
        return None

    def void_old_record(self, beats: list[control.Heartbeat], gens: Generations) -> None:
        """An exit record older than the new generation's first heartbeat belongs to the generation torchrun
        replaced (its ranks may have saved on torchrun's own SIGTERM while it stopped them): void."""
        path = self.folder / control.EXIT_FILE
        born = min((beat.mtime for beat in beats if beat.pid in gens.pids), default=None)
        try:
            if born is not None and path.stat().st_mtime < born:
                path.unlink()
        except FileNotFoundError:
            pass

    def final_code(self, outcome: Outcome, restarted: bool = False) -> int | None:
        """The supervisor's exit code when this outcome ends the launch; None: restart. `restarted`: this
        launch restarted the ranks before this outcome."""
        if outcome.kind == "done":
            return control.EXIT_DONE
        if outcome.kind == "finished" and restarted:
            # The crash restarted from came after the final save (at teardown): the run is complete.
            self.log(
                f"the run had finished before the crash this launch restarted after: done ({outcome.detail})"
            )
            return control.EXIT_DONE
        if outcome.kind in ("fatal", "finished"):  # under a stop signal too: a requeue would hit it again
            self.log(f"a restart cannot fix this, stopping: {outcome.detail}")
            return control.EXIT_FATAL
        if outcome.kind == "resumable" and outcome.detail:
            self.log(outcome.detail)  # the ranks' own message names the step and the checkpoint
            return control.EXIT_RESUMABLE
        if outcome.kind == "resumable" or self.stop_reason is not None:
            # Without the ranks' message (killed by a second signal), the latest checkpoint in save_folder is
            # where a rerun resumes; a crash says how torchrun ended.
            how = f" ({outcome.detail})" if outcome.detail else ""
            self.log(f"stopped on {self.stop_reason or 'request'}{how}; rerun the same command to resume")
            return control.EXIT_RESUMABLE
        return None

    def resume_point(self) -> str:
        progress = control.read_json(self.folder / control.PROGRESS_FILE) or {}
        checkpoint, saved = progress.get("checkpoint"), progress.get("saved_batch")
        if not checkpoint:
            return "the latest checkpoint in save_folder (none saved by this launch)"
        uploaded = progress.get("uploaded_batch")  # an s3:// save folder: the last save known to be there
        if not str(checkpoint).startswith("s3://") or uploaded == saved:
            return f"the checkpoint of step {saved} ({checkpoint})"
        if uploaded is None:
            return f"the latest checkpoint in save_folder (step {saved}'s was still uploading)"
        arrived = progress.get("uploaded_checkpoint")
        return f"the checkpoint of step {uploaded} ({arrived}; step {saved}'s was still uploading)"

    def attempt(self) -> Outcome:
        control.clear_attempt(self.folder)
        if self.stop_reason is not None:  # a signal between two attempts still stops the next one
            control.request_stop(self.folder, self.stop_reason)
        # torchrun through shared/runtime/exits.py: no traceback box when the ranks stopped on purpose.
        self.proc = subprocess.Popen(torchrun_argv(self.argv), env=self.attempt_env(), start_new_session=True)
        hung = None
        while self.proc.poll() is None and hung is None:
            time.sleep(self.supervision.poll_s)
            self.watch_shm()
            hung = self.stale_ranks()
        beats = control.read_heartbeats(self.folder)
        batch = max((beat.batch for beat in beats), default=-1)
        if hung is not None:
            closing = all(beat.finished for beat in beats if beat.rank in hung)
            self.tear_down(hung)
            what = "did not exit after training ended" if closing else "completed no step"
            return Outcome("hang", batch, f"rank(s) {hung} {what} for {self.supervision.hang_timeout_s:g} s")
        return self.classify(self.proc.returncode, batch)

    def attempt_env(self) -> dict[str, str]:
        """The ranks' environment: the control folder, the deadline, and a scratch TMPDIR removed with the
        control folder (nothing the run's processes put in a temp folder outlives the launch)."""
        scratch = self.folder / control.SCRATCH_DIR
        scratch.mkdir(exist_ok=True)
        node_tmp = self.env.get(NODE_TMPDIR_ENV) or self.env.get("TMPDIR") or tempfile.gettempdir()
        env = {**self.env, control.CONTROL_DIR_ENV: str(self.folder)}
        env.update({"TMPDIR": str(scratch), NODE_TMPDIR_ENV: node_tmp})
        if self.supervision.elastic:
            env.update(ELASTIC_ENV)
        if self.deadline is not None:
            env[control.DEADLINE_ENV] = f"{self.deadline:.3f}"
        return env

    def stale_ranks(self) -> list[int] | None:
        """Ranks whose last step is older than hang_timeout_s (None: all alive or not started stepping),
        and ranks still running that long after their trainer closed (train/resilience/monitor.py): a
        teardown that never returns (NCCL's) held the whole job until its scheduler's time limit."""
        now = time.time()
        stale = [
            b.rank
            for b in control.read_heartbeats(self.folder)
            if now - b.mtime > self.supervision.hang_timeout_s and (not b.finished or alive(b.pid))
        ]
        return stale or None

    def classify(self, returncode: int, batch: int) -> Outcome:
        """The ranks' own record first: under a supervisor they exit 0 after a resumable stop (torchrun's
        elastic agent would restart ranks that exit otherwise), and the supervisor exits 75 for them."""
        record = control.read_json(self.folder / control.EXIT_FILE) or {}
        if record.get("state") in ("resumable", "fatal", "finished"):
            return Outcome(record["state"], int(record.get("batch", batch)), str(record.get("message", "")))
        if record.get("state") == "outage" and returncode != 0:  # at the step the heartbeats reached
            return Outcome("outage", batch, str(record.get("message", "")))
        if returncode == 0:
            return Outcome("done", batch)
        return Outcome("crash", batch, f"torchrun exited {returncode}")

    def tear_down(self, hung: list[int]) -> None:
        """Log every rank's stack, then SIGKILL every process of the attempt."""
        assert self.proc is not None
        procs = descendants(self.proc.pid)
        ranks = {beat.pid: beat.rank for beat in control.read_heartbeats(self.folder)}
        self.log_stacks(hung, ranks)
        kill_ranks_first(self.proc.pid)
        kill_all([*procs, self.proc.pid])
        self.proc.wait()

    def log_stacks(self, hung: list[int], ranks: Mapping[int, int]) -> None:
        """`ranks`: pid -> rank (ranks.stacks_report)."""
        for line in stacks_report(hung, ranks, self.supervision.hang_timeout_s):
            self.log(line)
