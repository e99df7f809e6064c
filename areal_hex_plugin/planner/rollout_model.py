"""Phase 1b: the rollout replica program of one pool, solved exactly, and the workload shares it implies.

The paper's makespan program (Eq. 2) is bilinear as printed; for fixed replica counts y the best assignment is
x_psi proportional to y_psi * h_psi, so minimising the makespan is exactly maximising sum_psi y_psi * h_psi under
the per-pool GPU counts (paper.md §2.4 note): an unbounded knapsack (see :func:`solve_rollout`). Each replica
stage runs TP inside one machine; the TP degrees offered form a divisibility chain of the machine size, so
counting GPUs per pool is also an exact machine packing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class ReplicaConfig:
    """One candidate replica shape psi of a pool: ``pp`` stages of ``tp`` GPUs."""

    pool: str
    tp: int
    pp: int
    tokens_per_s: float  # h_psi: one replica's generation speed
    concurrency: int
    recompute_s: float = 0.0  # KV rebuild after each weight update (interrupted requests are re-prefilled)
    # The step's longest sample: a window's generation on the replica ends no earlier (0 where the window's steps
    # do not wait for it, ``inflight.as_run``).
    longest_s: float = 0.0
    drain_s: float = 0.0  # what a window that drains before its update adds (RolloutEstimate.drain_s)
    colocated: bool = (
        False  # on the machine its pool shares with training (weights arrive over its GPU links)
    )

    @property
    def gpus(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class RolloutSolution:
    counts: tuple[tuple[ReplicaConfig, int], ...]  # (psi, y_psi) with y_psi > 0
    tokens_per_s: float  # sum_psi y_psi * h_psi
    optimal: bool

    @property
    def replicas(self) -> int:
        return sum(y for _, y in self.counts)


def solve_rollout(configs: list[ReplicaConfig], gpus: int) -> RolloutSolution:
    """Replica counts of one pool's configurations maximising total generation speed on ``gpus`` GPUs (exact).

    An unbounded knapsack solved by dynamic programming on a short prefix of the capacity: with psi* the shape of
    best speed per GPU, some optimal fleet holds fewer than g(psi*) replicas of other shapes (among g(psi*) of
    them, a nonempty set spans a multiple of g(psi*) GPUs and copies of psi* do no worse there), so those use
    fewer than g(psi*) * max_psi g(psi) GPUs and copies of psi* fill the rest. The table over that prefix is
    computed once per set of shapes, so a pool of thousands of replicas costs no more than one of a few.
    """
    usable = tuple(c for c in configs if c.gpus <= gpus)
    if not usable:
        return RolloutSolution((), 0.0, True)
    star = max(usable, key=lambda c: (c.tokens_per_s / c.gpus, -c.gpus))
    span = star.gpus * max(c.gpus for c in usable)
    value, back = _prefix_table(usable, span)

    def total(c: int) -> float:
        return value[c] + (gpus - c) // star.gpus * star.tokens_per_s

    prefix = max(range(min(gpus, span) + 1), key=lambda c: (total(c), -c))
    counts: dict[ReplicaConfig, int] = {star: (gpus - prefix) // star.gpus}
    c = prefix
    while c > 0:
        k, c = back[c]
        if k >= 0:
            counts[usable[k]] = counts.get(usable[k], 0) + 1
    chosen = tuple((psi, counts[psi]) for psi in usable if counts.get(psi))
    return RolloutSolution(chosen, sum(psi.tokens_per_s * y for psi, y in chosen), True)


@cache
def _prefix_table(configs: tuple[ReplicaConfig, ...], span: int) -> tuple[list[float], list[tuple[int, int]]]:
    """Best speed on at most c GPUs for c = 0 .. span, and per c (shape added, or -1; the c it came from)."""
    value: list[float] = [0.0] * (span + 1)
    back: list[tuple[int, int]] = [(-1, 0)] * (span + 1)
    for c in range(1, span + 1):
        value[c], back[c] = value[c - 1], (-1, c - 1)
        for k, psi in enumerate(configs):
            if psi.gpus <= c and value[c - psi.gpus] + psi.tokens_per_s > value[c]:
                value[c], back[c] = value[c - psi.gpus] + psi.tokens_per_s, (k, c - psi.gpus)
    return value, back


def largest_remainder(total: int, weights: list[float]) -> list[int]:
    """Split ``total`` whole items in proportion to ``weights``; the parts sum to ``total`` exactly."""
    weight_sum = sum(weights)
    if total <= 0 or weight_sum <= 0:
        return [0] * len(weights)
    exact = [total * w / weight_sum for w in weights]
    parts = [int(x) for x in exact]
    # Ties go to the earlier entry, so the split is deterministic.
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - parts[i]), i))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts
