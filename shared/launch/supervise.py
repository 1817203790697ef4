"""`python -m shared.launch.supervise [flags] -- torchrun ...`: one node's supervisor, as sbatch scripts and
Kubernetes pods start it (the local launcher calls shared/launch/supervisor.py directly). Exits with the
supervisor's code (shared/launch/control.py), except a resumable stop with `--stopped-mark` (written, exit 0).
On Slurm it reads the job's end time and asks the ranks to save `--deadline-lead-s` seconds before it."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from shared.launch import control
from shared.launch.deadline import slurm_end_time
from shared.launch.supervisor import Supervision, Supervisor

DEFAULTS = Supervision()
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command(context_settings={"allow_interspersed_args": False})
def supervise(
    command: Annotated[list[str], typer.Argument(help="-- torchrun ... (the command to supervise)")],
    max_restarts: Annotated[
        int, typer.Option(help="restarts after a crash or a hang")
    ] = DEFAULTS.max_restarts,
    hang_timeout_s: Annotated[
        float, typer.Option(help="no step for this long: hung")
    ] = DEFAULTS.hang_timeout_s,
    deadline_lead_s: Annotated[
        float, typer.Option(help="save this long before a scheduler's end time")
    ] = DEFAULTS.deadline_lead_s,
    max_wall_time_s: Annotated[
        float | None, typer.Option(help="save and stop this long after the start")
    ] = None,
    elastic: Annotated[
        bool, typer.Option("--elastic", help="several nodes: torchrun restarts the ranks; only watch")
    ] = False,
    stopped_mark: Annotated[
        str | None,
        typer.Option(help="on a resumable stop write this file and exit 0 instead of 75 (srun, below)"),
    ] = None,
) -> None:
    """Run COMMAND (torchrun ...) under one node's supervisor; exits with its code."""
    supervision = Supervision(max_restarts, hang_timeout_s, max_wall_time_s, deadline_lead_s, elastic=elastic)
    end = slurm_end_time()
    deadline = None if end is None else end - supervision.deadline_lead_s
    command = with_store_host(command, os.environ.get("NODE_RANK"))
    code = Supervisor(command, supervision, deadline=deadline).run()
    if stopped_mark and code == control.EXIT_RESUMABLE:
        # srun --kill-on-bad-exit SIGKILLs every other node when one task exits non-zero: the nodes still
        # finishing their part of this same save would lose it, and srun's own code would no longer be 75.
        Path(stopped_mark).parent.mkdir(parents=True, exist_ok=True)
        Path(stopped_mark).write_text(f"{code}\n")
        code = control.EXIT_DONE
    raise typer.Exit(code)


def with_store_host(command: list[str], node_rank: str | None) -> list[str]:
    """torchrun's `--rdzv-conf` with `is_host` from this node's number (Slurm's node id, the pod's completion
    index: NODE_RANK), as the local launcher passes it: node 0 hosts the rendezvous store. Left to torch,
    the host is the node whose own address matches the endpoint, decided once at start, and a pod whose
    Service name did not resolve yet hosted nothing: every pod timed out and the Job spent its backoff."""
    if node_rank is None or not node_rank.isdigit():
        return command
    flag = "--rdzv-conf="
    out = []
    for word in command:
        if word.startswith(flag) and "is_host=" not in word:
            conf = word[len(flag) :]
            word = f"{flag}{conf + ',' if conf else ''}is_host={str(int(node_rank) == 0).lower()}"
        out.append(word)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI's exit code (usage errors print their message and give 2)."""
    try:
        app(args=list(sys.argv[1:] if argv is None else argv), prog_name="python -m shared.launch.supervise")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
