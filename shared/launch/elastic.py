"""Several nodes: what one node's supervisor sees of torchrun's elastic agent restarting the ranks.

The agent restarts every node's ranks itself (a `c10d` rendezvous, `--max-restarts`), so the supervisor only
sees its ranks' heartbeats (shared/launch/control.py) change hands: the processes that wrote them are gone,
and new processes write them. That change is a restart; the highest step of the generation that ended is
where it failed, and two restarts from the same step are a crash loop (the supervisor stops instead).
Light: the standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shared.launch.control import Heartbeat


@dataclass
class Generations:
    """The ranks' processes of the current generation on this node, and the restarts seen so far."""

    pids: set[int] = field(default_factory=set)
    batch: int = -1  # the highest step this generation completed
    restarts: int = 0
    last_failure: int | None = None  # the step the previous restart happened at
    cause: str = "crash"  # what ended the current generation, for the log: crash | hang

    def observe(self, beats: Iterable[Heartbeat], alive: Callable[[int], bool]) -> int | None:
        """Adopt this poll's heartbeats; the ended generation's highest step when a new one has started.

        New pids alone are no restart (a node's ranks write their first heartbeats one after another); new
        pids while some of the generation's processes are gone are. A clean exit writes no new heartbeat."""
        live = [beat for beat in beats if alive(beat.pid)]
        fresh = [beat for beat in live if beat.pid not in self.pids]
        ended = None
        if fresh and any(not alive(pid) for pid in self.pids):
            ended, self.pids, self.batch = self.batch, set(), -1
        for beat in live:
            self.pids.add(beat.pid)
            self.batch = max(self.batch, beat.batch)
        return ended

    def restarted(self, step: int) -> bool:
        """Count a restart from `step`; False when the previous one was from the same step (a crash loop)."""
        if self.last_failure == step:
            return False
        self.restarts, self.last_failure = self.restarts + 1, step
        return True

    def hung(
        self, beats: Iterable[Heartbeat], alive: Callable[[int], bool], now: float, timeout_s: float
    ) -> list[int]:
        """Ranks of this generation, still running (or stopped), whose last step is older than timeout_s."""
        return sorted(
            beat.rank
            for beat in beats
            if beat.pid in self.pids
            and not beat.finished
            and alive(beat.pid)
            and now - beat.mtime > timeout_s
        )
