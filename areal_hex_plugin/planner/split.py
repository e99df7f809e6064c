"""A split of the inventory at machine granularity: how many machines of each pool train, generate or idle.

Machines of one pool are identical, so a split is two count vectors (one entry per pool, in cluster order):
this is the symmetry-free form of the paper's D_T / D_I bisection. On a small inventory (at most
SHARED_MACHINES machines in play, :func:`shared_choices`) one machine per pool may also be shared between the
roles, as upstream's ``sglang.d4+fsdp.d4`` on one node: its first ``shared[i]`` GPUs train, the rest generate.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product

from areal_hex_plugin.specs.cluster import SHARED_MACHINES, Cluster


@dataclass(frozen=True, order=True)
class Split:
    train: tuple[int, ...]
    rollout: tuple[int, ...]
    # Per pool, the GPUs of one further machine that train while its other GPUs generate (0: no shared machine);
    # () when no pool shares one.
    shared: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not any(self.shared):
            object.__setattr__(self, "shared", ())

    def shared_gpus(self, i: int) -> int:
        """GPUs of pool i's shared machine that train (0: the pool shares none)."""
        return self.shared[i] if self.shared else 0

    def machines(self, i: int) -> int:
        """Machines of pool i the split rents."""
        return self.train[i] + self.rollout[i] + (1 if self.shared_gpus(i) else 0)

    def train_gpus(self, cluster: Cluster) -> tuple[int, ...]:
        """Training GPUs per pool: whole training machines and the shared machine's training part."""
        return tuple(
            t * p.gpus_per_machine + self.shared_gpus(i)
            for i, (t, p) in enumerate(zip(self.train, cluster.pools, strict=True))
        )

    def colocated_gpus(self, cluster: Cluster) -> tuple[int, ...]:
        """Rollout GPUs per pool on its shared machine (beside the training part)."""
        return tuple(
            p.gpus_per_machine - g if (g := self.shared_gpus(i)) else 0 for i, p in enumerate(cluster.pools)
        )

    def trains(self) -> bool:
        return any(self.train) or bool(self.shared)

    def generates(self) -> bool:
        return any(self.rollout) or bool(self.shared)

    def cost_per_hour(self, cluster: Cluster) -> float:
        return sum(self.machines(i) * p.price_per_machine_hour for i, p in enumerate(cluster.pools))

    def neighbours(self, limits: tuple[int, ...], stride: int = 1) -> Iterator[Split]:
        """Splits one move away inside a pool: ``stride`` machines change role (train, rollout, idle), or the
        pool's machines swap roles, turn to one role or are rented; and the mirror split (every pool swaps roles)."""
        for i in range(len(limits)):
            yield from self._moved(i, limits, stride=stride)
        mirror = Split(self.rollout, self.train)
        if mirror != self and not self.shared:
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
        role, or its idle machines go to training, to rollout or half to each); a shared machine stays shared."""
        t, r, k = self.train[i], self.rollout[i], stride
        steps = [(t + dt, r + dr) for dt, dr in ((-k, k), (k, -k), (k, 0), (0, k), (-k, 0), (0, -k))]
        limit = limits[i] - (1 if self.shared_gpus(i) else 0)
        idle = limit - t - r
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
            if nt >= 0 and nr >= 0 and nt + nr <= limit and (nt, nr) not in seen:
                seen.add((nt, nr))
                yield Split(_set(self.train, i, nt), _set(self.rollout, i, nr), self.shared)


def _set(values: tuple[int, ...], i: int, value: int) -> tuple[int, ...]:
    return values[:i] + (value,) + values[i + 1 :]


def shared_choices(cluster: Cluster, limits: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Per pool, the training GPUs a shared machine may have: a quarter, half or three quarters of it (half
    where the machine size is not a multiple of 4), on inventories of at most SHARED_MACHINES machines in play;
    none elsewhere (a shared machine pays off where a whole one per role costs too much of the inventory)."""
    if sum(limits) > SHARED_MACHINES:
        return tuple(() for _ in limits)
    out = []
    for pool, m in zip(cluster.pools, limits, strict=True):
        g = pool.gpus_per_machine
        if not m or g < 2 or g % 2:
            out.append(())
        else:
            out.append((g // 4, g // 2, 3 * g // 4) if g % 4 == 0 else (g // 2,))
    return tuple(out)


def shared_splits(limits: tuple[int, ...], choices: tuple[tuple[int, ...], ...]) -> Iterator[Split]:
    """Every split that shares at least one machine (:func:`shared_choices`; a shared machine holds both roles,
    so each of these trains and generates): what :func:`all_splits` adds to the whole-machine splits."""
    if not any(choices):
        return
    per_pool = [
        [(t, r, 0) for t in range(m + 1) for r in range(m + 1 - t)]
        + [(t, r, g) for g in c for t in range(m) for r in range(m - t)]
        for m, c in zip(limits, choices, strict=True)
    ]
    for choice in product(*per_pool):
        if any(g for _, _, g in choice):
            yield Split(
                tuple(t for t, _, _ in choice), tuple(r for _, r, _ in choice), tuple(g for *_, g in choice)
            )


def all_splits(
    limits: tuple[int, ...], choices: tuple[tuple[int, ...], ...] | None = None
) -> Iterator[Split]:
    """Every split with at least one training and one rollout machine (the exhaustive search space), and with
    ``choices`` (:func:`shared_choices`) every split sharing machines too."""
    per_pool = [[(t, r) for t in range(m + 1) for r in range(m + 1 - t)] for m in limits]
    for choice in product(*per_pool):
        train = tuple(t for t, _ in choice)
        rollout = tuple(r for _, r in choice)
        if any(train) and any(rollout):
            yield Split(train, rollout)
    if choices is not None:
        yield from shared_splits(limits, choices)


def count_splits(limits: tuple[int, ...]) -> int:
    total = 1
    for m in limits:
        total *= (m + 1) * (m + 2) // 2
    return total
