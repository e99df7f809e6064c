"""The cost-guided repartition on CP-SAT: the GRAPH_PARTITION(C_T, C_I, D) step of the EM alternation.

Phase 1 measured, per pool, the training steps/s the pool reaches alone on n machines (f_p(n)) and the steps'
worth of rollouts per second it generates on n machines (g_p(n)), at a grid of machine counts. With those tables
frozen (step functions between grid points, never decreasing: extra machines may idle), the split maximising the
step rate min(sum_p f_p(t_p), sum_p g_p(r_p)) within the machine limits and the budget is a small integer program
(table lookups are CP-SAT element constraints); ties go to the cheaper split. The alternation then measures the
tables at the new split (the E step) and solves again until the split repeats.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from areal_hex_plugin.planner.cpsat import Model, budget_cents, found, solve_model
from areal_hex_plugin.planner.split import Split
from areal_hex_plugin.specs.cluster import Cluster

_RESOLUTION = 1_000_000  # the largest table entry is worth this many units


@dataclass(frozen=True)
class BalanceRequest:
    limits: tuple[int, ...]
    budget_per_hour: float | None
    train_rate: tuple[tuple[float, ...], ...]  # f_p(n) for n = 0 .. limit_p: training steps/s, pool alone
    rollout_rate: tuple[tuple[float, ...], ...]  # g_p(n): rollout steps/s of n machines of pool p


def solve_balance(
    cluster: Cluster, request: BalanceRequest, time_limit_s: float, num_workers: int, seed: int
) -> tuple[Split | None, float]:
    """The split (None where none fits) and the work its solve charged to the search's clock."""
    built = _build(cluster, request)
    if built is None:
        return None, 0.0
    model, train, rollout = built
    solver, status = solve_model(model, time_limit_s, num_workers, seed)
    if not found(status):
        return None, solver.deterministic_time
    split = Split(tuple(solver.value(t) for t in train), tuple(solver.value(r) for r in rollout))
    return split, solver.deterministic_time


def _scaled(table: tuple[float, ...], top: float) -> list[int]:
    return [round(x / top * _RESOLUTION) for x in table]


def _build(cluster: Cluster, req: BalanceRequest):
    top = max(max(max(t) for t in req.train_rate), max(max(t) for t in req.rollout_rate))
    if (
        top <= 0
        or not any(max(t) > 0 for t in req.train_rate)
        or not any(max(t) > 0 for t in req.rollout_rate)
    ):
        return None
    model = Model()
    train, rollout, train_terms, rollout_terms = [], [], [], []
    for pool, limit, f, g in zip(cluster.pools, req.limits, req.train_rate, req.rollout_rate, strict=True):
        t = model.new_int_var(0, limit, f"t_{pool.name}")
        r = model.new_int_var(0, limit, f"r_{pool.name}")
        model.add(t + r <= limit)
        train_terms.append(_lookup(model, t, _scaled(f, top), f"f_{pool.name}"))
        rollout_terms.append(_lookup(model, r, _scaled(g, top), f"g_{pool.name}"))
        train.append(t)
        rollout.append(r)
    cents = [round(p.price_per_machine_hour * 100) for p in cluster.pools]
    cost = sum(c * (t + r) for c, t, r in zip(cents, train, rollout, strict=True))
    if req.budget_per_hour is not None:
        model.add(cost <= budget_cents(req.budget_per_hour))
    rate = model.new_int_var(0, _RESOLUTION * len(req.limits), "step_rate")
    model.add(rate <= sum(train_terms))
    model.add(rate <= sum(rollout_terms))
    model.add(sum(train) >= 1)
    model.add(sum(rollout) >= 1)
    # Lexicographic: any gain in step rate beats any saving in cost.
    max_cost = sum(c * m for c, m in zip(cents, req.limits, strict=True))
    model.maximize(rate * (max_cost + 1) - cost)
    return model, train, rollout


def _lookup(model: cp_model.CpModel, index, table: list[int], name: str):
    value = model.new_int_var(0, max(table), name)
    model.add_element(index, table, value)
    return value
