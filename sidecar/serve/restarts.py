"""When a process that died is started again, and when to stop trying.

One rule for every supervisor in the product: the sidecar's worker supervisor
(``serve --workers N``) and the local stack behind ``model-router up``. A
process that exits unexpectedly is restarted after a backoff that doubles
from ``backoff[0]`` to ``backoff[1]`` seconds and starts over once a run has
lasted ``stable_after`` seconds; after ``give_up[0]`` exits within
``give_up[1]`` seconds the supervisor stops trying.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    backoff: tuple[float, float] = (0.5, 10.0)
    stable_after: float = 30.0
    give_up: tuple[int, float] = (5, 60.0)


@dataclass
class Restarts:
    """One process's unexpected exits, judged by a :class:`RestartPolicy`."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    deaths: list[float] = field(default_factory=list)  # monotonic times of exits inside the window
    failures: int = 0  # consecutive short-lived runs: the exponent of the next backoff
    up_since: float | None = None  # last seen up

    def up(self, now: float) -> None:
        self.up_since = now

    def exited(self, now: float) -> float | None:
        """Seconds to wait before the restart, or None when it exits too often."""
        limit, window = self.policy.give_up
        self.deaths = [t for t in self.deaths if now - t < window] + [now]
        if self.up_since is not None and now - self.up_since >= self.policy.stable_after:
            self.failures = 0
        self.up_since = None
        if len(self.deaths) >= limit:
            return None
        first, cap = self.policy.backoff
        delay = min(first * 2.0 ** self.failures, cap)
        self.failures += 1
        return delay

    def window(self) -> str:
        """The give-up rule in words, for messages."""
        return f"{len(self.deaths)} times within {self.policy.give_up[1]:g} s"
