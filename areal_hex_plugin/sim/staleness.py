"""Admission control with upstream AReaL's ``StalenessManager`` semantics (areal/infra/staleness_manager.py).

Counts are rollouts (one prompt with its ``n_samples`` responses), as upstream counts workflow episodes.
``tests/sim/test_staleness_agrees_with_upstream.py`` drives this and the real upstream class with the same
random event sequences and asserts identical capacities.
"""

from __future__ import annotations


class AdmissionControl:
    """capacity = min(max_concurrent - running, (eta + version + 1) * batch - (accepted + running))."""

    def __init__(self, max_concurrent_rollouts: int, consumer_batch_size: int, max_staleness: int) -> None:
        # Upstream clamps both to at least 1 when computing the capacity.
        self.max_concurrent = max(1, max_concurrent_rollouts)
        self.batch = max(1, consumer_batch_size)
        self.max_staleness = max_staleness
        self.running = 0
        self.accepted = 0
        self.rejected = 0

    def capacity(self, version: int) -> int:
        """New rollouts that may start now; negative when over either limit."""
        concurrency = self.max_concurrent - self.running
        staleness = (self.max_staleness + version + 1) * self.batch - (self.accepted + self.running)
        return min(concurrency, staleness)

    def on_submitted(self) -> None:
        self.running += 1

    def on_accepted(self) -> None:
        self.running -= 1
        self.accepted += 1

    def on_rejected(self) -> None:
        self.running -= 1
        self.rejected += 1
