"""The cost-guided repartition on CP-SAT: the GRAPH_PARTITION(C_T, C_I, D) step of the EM alternation.

Phase 1 measured, at the current split, how many training steps per second one machine of each pool adds to the
trainer (a_p) and how many steps' worth of rollouts it adds to the fleet (b_p). With those rates frozen, the split
that maximises the step rate min(sum_p t_p a_p, sum_p r_p b_p) within the machine limits and the budget is a small
integer program; ties go to the cheaper split. Phase 1 then re-measures the rates at the new split (the E step)
until the split repeats.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from areal_hex_plugin.scheduler.cpsat import found, solve_model
from areal_hex_plugin.scheduler.split import Split
from areal_hex_plugin.specs.cluster import Cluster

_RESOLUTION = 1_000_000  # the fastest per-machine rate is worth this many units


@dataclass(frozen=True)
class BalanceRequest:
    limits: tuple[int, ...]
    budget_per_hour: float | None
    train_rate: tuple[float, ...]  # a_p: training steps/s one machine of pool p adds
    rollout_rate: tuple[float, ...]  # b_p: rollout steps/s one machine of pool p adds


def solve_balance(
    cluster: Cluster, request: BalanceRequest, time_limit_s: float, num_workers: int, seed: int
) -> Split | None:
    model, train, rollout = _build(cluster, request)
    if model is None:
        return None
    solver, status = solve_model(model, time_limit_s, num_workers, seed)
    if not found(status):
        return None
    return Split(tuple(solver.value(t) for t in train), tuple(solver.value(r) for r in rollout))


def _build(cluster: Cluster, req: BalanceRequest):
    fastest = max(max(req.train_rate), max(req.rollout_rate))
    if max(req.train_rate) <= 0 or max(req.rollout_rate) <= 0:
        return None, [], []
    a = [round(x / fastest * _RESOLUTION) for x in req.train_rate]
    b = [round(x / fastest * _RESOLUTION) for x in req.rollout_rate]
    model = cp_model.CpModel()
    train = [
        model.new_int_var(0, m if w > 0 else 0, f"t_{p.name}")
        for p, m, w in zip(cluster.pools, req.limits, a, strict=True)
    ]
    rollout = [
        model.new_int_var(0, m if w > 0 else 0, f"r_{p.name}")
        for p, m, w in zip(cluster.pools, req.limits, b, strict=True)
    ]
    for t, r, m in zip(train, rollout, req.limits, strict=True):
        model.add(t + r <= m)
    cents = [round(p.price_per_machine_hour * 100) for p in cluster.pools]
    cost = sum(c * (t + r) for c, t, r in zip(cents, train, rollout, strict=True))
    if req.budget_per_hour is not None:
        model.add(cost <= int(req.budget_per_hour * 100))
    bound = max(
        sum(w * m for w, m in zip(a, req.limits, strict=True)),
        sum(w * m for w, m in zip(b, req.limits, strict=True)),
    )
    rate = model.new_int_var(0, bound, "step_rate")
    model.add(rate <= sum(w * t for w, t in zip(a, train, strict=True)))
    model.add(rate <= sum(w * r for w, r in zip(b, rollout, strict=True)))
    model.add(sum(train) >= 1)
    model.add(sum(rollout) >= 1)
    # Lexicographic: any gain in step rate beats any saving in cost.
    max_cost = sum(c * m for c, m in zip(cents, req.limits, strict=True))
    model.maximize(rate * (max_cost + 1) - cost)
    return model, train, rollout
