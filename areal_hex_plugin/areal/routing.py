"""Route rollout requests across unequal servers by the plan's shares (pure; used by HexRolloutController).

``shares``: smooth weighted round-robin, so over any window of requests each server's fraction follows its
share within one request. ``least_outstanding``: the server with the fewest requests in flight per unit of
share (a fast server drains its queue sooner and so gets more), ties broken by the weighted round-robin.
Every :meth:`ShareRouter.choose` is matched by one :meth:`ShareRouter.release`, which counts the request as
completed (it produced a result) or failed (error, time-out, abort, or no trajectory). A server with share 0 (lost,
or not yet holding the current weights) gets no request; :meth:`ShareRouter.set_shares` changes the shares while
requests are in flight; :meth:`ShareRouter.add_server` adds a server (a machine that joined) with share 0.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from areal_hex_plugin.specs.config import ROUTING_POLICIES


class ShareRouter:
    def __init__(self, shares: Sequence[float], policy: str = "shares") -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; use one of {', '.join(ROUTING_POLICIES)}")
        self.shares = self._normalised(shares)
        self.policy = policy
        self.outstanding = [0] * len(shares)
        self.completed = [0] * len(shares)
        self.failed = [0] * len(shares)
        self._credit = [0.0] * len(shares)
        self._lock = threading.Lock()

    @staticmethod
    def _normalised(shares: Sequence[float]) -> list[float]:
        if not shares or any(s < 0 for s in shares) or not any(s > 0 for s in shares):
            raise ValueError(f"shares must be non-negative with one positive, got {list(shares)}")
        total = float(sum(shares))
        return [s / total for s in shares]

    def set_shares(self, shares: Sequence[float]) -> None:
        """Route by ``shares`` from now on (one per server, as many as before; the requests in flight stay)."""
        if len(shares) != len(self.shares):
            raise ValueError(f"{len(shares)} shares for {len(self.shares)} servers")
        with self._lock:
            self.shares = self._normalised(shares)
            self._credit = [0.0] * len(shares)

    def add_server(self) -> int:
        """One more server, with share 0 until :meth:`set_shares` gives it one; its index."""
        with self._lock:
            for counts in (self.shares, self.outstanding, self.completed, self.failed, self._credit):
                counts.append(0)
            return len(self.shares) - 1

    def _round_robin(self, candidates: list[int]) -> int:
        for i in range(len(self.shares)):
            self._credit[i] += self.shares[i]
        best = max(candidates, key=lambda i: self._credit[i])
        self._credit[best] -= 1.0
        return best

    def choose(self) -> int:
        """The server for the next request (counted as in flight until :meth:`release`)."""
        with self._lock:
            candidates = [i for i, share in enumerate(self.shares) if share > 0]
            if self.policy == "least_outstanding":
                load = [self.outstanding[i] / self.shares[i] for i in candidates]
                candidates = [i for i in candidates if load[i] == min(load)]
            index = self._round_robin(candidates)
            self.outstanding[index] += 1
            return index

    def release(self, index: int, completed: bool = True) -> None:
        """The request chosen for server ``index`` is over: it ``completed``, or failed."""
        with self._lock:
            if self.outstanding[index] <= 0:
                raise RuntimeError(f"server {index} has no request in flight to release")
            self.outstanding[index] -= 1
            (self.completed if completed else self.failed)[index] += 1

    def take_completed(self) -> list[int]:
        """Requests each server completed since the last call."""
        with self._lock:
            done, self.completed = self.completed, [0] * len(self.shares)
            return done

    def take_failed(self) -> list[int]:
        """Requests each server failed since the last call."""
        with self._lock:
            failed, self.failed = self.failed, [0] * len(self.shares)
            return failed
