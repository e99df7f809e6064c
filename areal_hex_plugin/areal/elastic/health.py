"""Each rollout server's health: up, down or joining, from its ``/health`` probes; draining or retired while a
live re-layout replaces it (``relayout.py``).

``failures_to_down`` failed probes in a row mark a server down, so it leaves the routing at most
:attr:`ServerHealth.deadline_s` after it stops answering; a request that fails has its server probed at once.
A relaunched or joined server is joining until it holds the trainer's committed version. A draining server takes
no new requests but finishes the ones it holds and still takes control calls; a retired one was stopped on
purpose: it is never probed, called or relaunched again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from areal_hex_plugin.specs.config import ElasticConfig

UP, DOWN, JOINING, DRAINING, RETIRED = "up", "down", "joining", "draining", "retired"
# States whose server takes no calls.
GONE = (DOWN, RETIRED)


def http_probe(address: str, timeout_s: float) -> bool:
    """Whether the server at ``host:port`` answers ``/health`` within ``timeout_s``."""
    import requests

    try:
        return requests.get(f"http://{address}/health", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


@dataclass(frozen=True)
class Detection:
    """A server marked down: when its first failed probe was, and when it was marked."""

    rank: int
    first_failure: float
    marked: float


class ServerHealth:
    """Server states and failed-probe counts; not thread-safe on its own (the caller holds its lock)."""

    def __init__(
        self,
        config: ElasticConfig,
        addresses: Sequence[str],
        probe: Callable[[str, float], bool] = http_probe,
    ) -> None:
        self.config = config
        self.addresses = list(addresses)
        self.states = [UP] * len(addresses)
        self.failures = [0] * len(addresses)
        self._first_failure: list[float | None] = [None] * len(addresses)
        self._probe = probe

    @property
    def deadline_s(self) -> float:
        """At most this long from a server's last answer to its leaving the routing."""
        c = self.config
        return c.failures_to_down * (c.health_interval_s + c.health_timeout_s)

    def probe(self, rank: int) -> bool:
        """Whether ``rank``'s server answers now."""
        return self._probe(self.addresses[rank], self.config.health_timeout_s)

    def to_probe(self) -> list[int]:
        """The servers a probe round asks: every one not down or retired."""
        return [rank for rank, state in enumerate(self.states) if state not in GONE]

    def record(self, rank: int, ok: bool) -> bool:
        """Count one probe of ``rank``; whether the server has now failed enough probes to be marked down."""
        if self.states[rank] in GONE:
            return False
        if ok:
            self.failures[rank], self._first_failure[rank] = 0, None
            return False
        self.failures[rank] += 1
        if self._first_failure[rank] is None:
            self._first_failure[rank] = time.time()
        return self.failures[rank] >= self.config.failures_to_down

    def mark_down(self, rank: int) -> Detection:
        """``rank`` leaves: down from now."""
        now = time.time()
        self.states[rank] = DOWN
        return Detection(rank, self._first_failure[rank] or now, now)

    def relaunched(self, rank: int, address: str) -> None:
        """``rank``'s server runs again at ``address``: joining until it holds the committed version."""
        self.addresses[rank] = address
        self.failures[rank], self._first_failure[rank] = 0, None
        self.states[rank] = JOINING

    def add(self, address: str) -> int:
        """A new server (a machine that joins), joining; its rank."""
        self.addresses.append(address)
        self.failures.append(0)
        self._first_failure.append(None)
        self.states.append(JOINING)  # last: control calls reach a rank once it has a state
        return len(self.states) - 1

    def live(self) -> list[bool]:
        """Which servers take requests."""
        return [state == UP for state in self.states]
