"""`python -m shared.launch.supervise [flags] -- torchrun ...`: one node's supervisor, as sbatch scripts and
Kubernetes pods start it (the local launcher calls shared/launch/supervisor.py directly). Exits with the
supervisor's code (shared/launch/control.py). On Slurm it reads the job's end time and asks the ranks to
save `--deadline-lead-s` seconds before it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shared.launch.deadline import slurm_end_time
from shared.launch.supervisor import Supervision, Supervisor


def parse(argv: Sequence[str]) -> tuple[Supervision, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m shared.launch.supervise")
    parser.add_argument("--max-restarts", type=int, default=Supervision.max_restarts)
    parser.add_argument("--hang-timeout-s", type=float, default=Supervision.hang_timeout_s)
    parser.add_argument("--deadline-lead-s", type=float, default=Supervision.deadline_lead_s)
    parser.add_argument("--max-wall-time-s", type=float, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- torchrun ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to supervise after --")
    return Supervision(
        args.max_restarts, args.hang_timeout_s, args.max_wall_time_s, args.deadline_lead_s
    ), command


def main(argv: Sequence[str] | None = None) -> int:
    supervision, command = parse(sys.argv[1:] if argv is None else argv)
    end = slurm_end_time()
    deadline = None if end is None else end - supervision.deadline_lead_s
    return Supervisor(command, supervision, deadline=deadline).run()


if __name__ == "__main__":
    sys.exit(main())
