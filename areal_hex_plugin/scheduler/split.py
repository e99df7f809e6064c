"""A split of the inventory at machine granularity: how many machines of each pool train, generate or idle.

Machines of one pool are identical, so a split is two count vectors (one entry per pool, in cluster order):
this is the symmetry-free form of the paper's D_T / D_I bisection.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product

from areal_hex_plugin.specs.cluster import Cluster


@dataclass(frozen=True, order=True)
class Split:
    train: tuple[int, ...]
    rollout: tuple[int, ...]

    def cost_per_hour(self, cluster: Cluster) -> float:
        return sum(
            (t + r) * p.price_per_machine_hour
            for t, r, p in zip(self.train, self.rollout, cluster.pools, strict=True)
        )

    def neighbours(self, limits: tuple[int, ...], stride: int = 1) -> Iterator[Split]:
        """Splits one move away inside a pool: ``stride`` machines change role (train, rollout, idle), or the
        pool's machines swap roles, turn to one role or are rented; and the mirror split (every pool swaps roles)."""
        for i in range(len(limits)):
            yield from self._moved(i, limits, stride=stride)
        mirror = Split(self.rollout, self.train)
        if mirror != self:
            yield mirror

    def pair_neighbours(self, limits: tuple[int, ...], whole: bool = True) -> Iterator[Split]:
        """Splits two moves away, in one pool or two (e.g. release a machine here, rent one there); ``whole``:
        whole-pool moves count as moves too (else only single machines move)."""
        seen = {self}
        for i in range(len(limits)):
            for first in self._moved(i, limits, whole):
                for j in range(i, len(limits)):
                    for second in first._moved(j, limits, whole):
                        if second not in seen:
                            seen.add(second)
                            yield second

    def _moved(
        self, i: int, limits: tuple[int, ...], whole_pool: bool = True, stride: int = 1
    ) -> Iterator[Split]:
        """``stride`` machines of pool i change role, or the whole pool does (swaps roles, all of it turns to one
        role, or its idle machines go to training, to rollout or half to each)."""
        t, r, k = self.train[i], self.rollout[i], stride
        steps = [(t + dt, r + dr) for dt, dr in ((-k, k), (k, -k), (k, 0), (0, k), (-k, 0), (0, -k))]
        idle = limits[i] - t - r
        whole = [
            (r, t),
            (t + r, 0),
            (0, t + r),
            (t + idle, r),
            (t, r + idle),
            (t + idle // 2, r + idle - idle // 2),
        ]
        if not whole_pool:
            whole = []
        seen = {(t, r)}
        for nt, nr in steps + whole:
            if nt >= 0 and nr >= 0 and nt + nr <= limits[i] and (nt, nr) not in seen:
                seen.add((nt, nr))
                yield Split(_set(self.train, i, nt), _set(self.rollout, i, nr))


def _set(values: tuple[int, ...], i: int, value: int) -> tuple[int, ...]:
    return values[:i] + (value,) + values[i + 1 :]


def all_splits(limits: tuple[int, ...]) -> Iterator[Split]:
    """Every split with at least one training and one rollout machine (the exhaustive search space)."""
    per_pool = [[(t, r) for t in range(m + 1) for r in range(m + 1 - t)] for m in limits]
    for choice in product(*per_pool):
        train = tuple(t for t, _ in choice)
        rollout = tuple(r for _, r in choice)
        if any(train) and any(rollout):
            yield Split(train, rollout)


def count_splits(limits: tuple[int, ...]) -> int:
    total = 1
    for m in limits:
        total *= (m + 1) * (m + 2) // 2
    return total
