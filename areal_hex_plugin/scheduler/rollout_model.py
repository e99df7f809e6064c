"""Phase 1b: the rollout integer program on CP-SAT, and the workload shares it implies.

The paper's makespan program (Eq. 2) is bilinear as printed; for fixed replica counts y the best assignment is
x_psi proportional to y_psi * h_psi, so minimising the makespan is exactly maximising sum_psi y_psi * h_psi under
the per-pool GPU counts (paper.md §2.4 note). Each replica stage runs TP inside one machine; the TP degrees
offered form a divisibility chain of the machine size, so counting GPUs per pool is also an exact machine packing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from areal_hex_plugin.scheduler.cpsat import found, solve_model

# Throughputs are scaled to integers with this resolution relative to the fastest configuration.
_RESOLUTION = 1_000_000


@dataclass(frozen=True)
class ReplicaConfig:
    """One candidate replica shape psi of a pool: ``pp`` stages of ``tp`` GPUs."""

    pool: str
    tp: int
    pp: int
    tokens_per_s: float  # h_psi: one replica's generation speed
    concurrency: int
    recompute_s: float = 0.0  # KV rebuild after each weight update (interrupted requests are re-prefilled)

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


def solve_rollout(
    configs: list[ReplicaConfig], gpus: int, time_limit_s: float, num_workers: int, seed: int
) -> RolloutSolution:
    """Replica counts of one pool's configurations maximising total generation speed on ``gpus`` GPUs."""
    usable = [c for c in configs if c.gpus <= gpus]
    if not usable:
        return RolloutSolution((), 0.0, True)
    model, counts = _build(usable, gpus)
    solver, status = solve_model(model, time_limit_s, num_workers, seed)
    return _read_back(solver, status, usable, counts)


def _build(configs: list[ReplicaConfig], gpus: int) -> tuple[cp_model.CpModel, list[cp_model.IntVar]]:
    model = cp_model.CpModel()
    fastest = max(c.tokens_per_s for c in configs)
    counts = [model.new_int_var(0, gpus // c.gpus, f"y_tp{c.tp}_pp{c.pp}") for c in configs]
    model.add(sum(c.gpus * y for c, y in zip(configs, counts, strict=True)) <= gpus)
    weights = [round(c.tokens_per_s / fastest * _RESOLUTION) for c in configs]
    model.maximize(sum(w * y for w, y in zip(weights, counts, strict=True)))
    return model, counts


def _read_back(
    solver: cp_model.CpSolver, status: int, configs: list[ReplicaConfig], counts: list
) -> RolloutSolution:
    if not found(status):
        return RolloutSolution((), 0.0, False)
    chosen = tuple((c, solver.value(y)) for c, y in zip(configs, counts, strict=True) if solver.value(y) > 0)
    total = sum(c.tokens_per_s * y for c, y in chosen)
    return RolloutSolution(chosen, total, status == cp_model.OPTIMAL)


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
