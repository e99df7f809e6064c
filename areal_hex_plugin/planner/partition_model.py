"""Phase 2: the repartition of Eq. (3) on CP-SAT, at machine granularity.

Maximise (bandwidth between training GPUs / bandwidth between all GPUs) + (HBM bandwidth of rollout GPUs / all
HBM bandwidth), with training's share of the used compute inside [gamma_lo, gamma_hi]. With t_p training machines
of pool p (g_p GPUs each), the GPU pairs inside D_T are t_p * C(g_p, 2) intra-machine pairs, C(t_p, 2) * g_p^2
pairs between machines of p and t_p * t_q * g_p * g_q pairs across pools p, q: a quadratic objective in the
counts, which CP-SAT takes through product variables. A pool of more than PARTITION_STEPS machines trains in
steps of whole blocks of machines, so the products stay small at thousands of machines.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from areal_hex_plugin.planner.cpsat import Model, budget_cents, found, solve_model
from areal_hex_plugin.planner.split import Split
from areal_hex_plugin.specs.cluster import Cluster

_SCALE = 1_000_000  # each Eq. (3) term is worth at most this many objective units
# A pool's training machine count takes at most this many steps (plus zero) in the model.
PARTITION_STEPS = 16


@dataclass(frozen=True)
class PartitionRequest:
    limits: tuple[int, ...]  # machines of each pool that may be used
    gamma_lo: float
    gamma_hi: float
    budget_per_hour: float | None  # None: every machine within the limits is used (D_T u D_I = D)


def solve_partition(
    cluster: Cluster, request: PartitionRequest, time_limit_s: float, num_workers: int, seed: int
) -> Split | None:
    """The Eq. (3) split for one compute-share band, or None when no split satisfies it."""
    model, train, rollout = _build(cluster, request)
    solver, status = solve_model(model, time_limit_s, num_workers, seed)
    if not found(status):
        return None
    return Split(tuple(solver.value(t) for t in train), tuple(solver.value(r) for r in rollout))


def _build(cluster: Cluster, req: PartitionRequest) -> tuple[cp_model.CpModel, list, list]:
    pools = cluster.pools
    model = Model()
    train = [model.new_int_var(0, m, f"t_{p.name}") for p, m in zip(pools, req.limits, strict=True)]
    rollout = [model.new_int_var(0, m, f"r_{p.name}") for p, m in zip(pools, req.limits, strict=True)]
    for t, r, m in zip(train, rollout, req.limits, strict=True):
        if req.budget_per_hour is None:
            model.add(t + r == m)
        else:
            model.add(t + r <= m)
    # Large pools: training machines in steps of `unit` (at most PARTITION_STEPS + 1 values), so the products of
    # the quadratic objective stay small; the balance model and the local search then work machine by machine.
    steps = []
    for p, t, m in zip(pools, train, req.limits, strict=True):
        unit = max(1, -(-m // PARTITION_STEPS))
        count = model.new_int_var(0, m // unit, f"steps_{p.name}") if unit > 1 else t
        model.add(t == unit * count)
        steps.append((count, unit))
    model.add(sum(train) >= 1)
    model.add(sum(rollout) >= 1)
    if req.budget_per_hour is not None:
        cents = [round(p.price_per_machine_hour * 100) for p in pools]
        model.add(
            sum(c * (t + r) for c, t, r in zip(cents, train, rollout, strict=True))
            <= budget_cents(req.budget_per_hour)
        )

    # Training compute share in [gamma_lo, gamma_hi] of the compute in use (GFLOPS per machine, integers).
    compute = [round(p.gpu.tflops_bf16 * p.gpus_per_machine * 1000) for p in pools]
    used = sum(c * (t + r) for c, t, r in zip(compute, train, rollout, strict=True))
    trained = sum(c * t for c, t in zip(compute, train, strict=True))
    permille_lo, permille_hi = round(req.gamma_lo * 1000), round(req.gamma_hi * 1000)
    model.add(1000 * trained >= permille_lo * used)
    model.add(1000 * trained <= permille_hi * used)

    link_terms, link_total = _link_terms(model, cluster, steps, req.limits)
    hbm = [p.gpu.hbm_tb_per_s * p.gpus_per_machine for p in pools]
    hbm_total = sum(h * m for h, m in zip(hbm, req.limits, strict=True))
    objective = [round(w * _SCALE / link_total) * v for w, v in link_terms]
    objective += [round(h * _SCALE / hbm_total) * r for h, r in zip(hbm, rollout, strict=True)]
    model.maximize(sum(objective))
    return model, train, rollout


def _link_terms(model: cp_model.CpModel, cluster: Cluster, steps: list, limits: tuple[int, ...]):
    """(bandwidth weight, variable) pairs whose sum is the bandwidth inside D_T, and the total over D; ``steps``
    holds per pool (s, unit) with t = unit * s training machines."""
    pools = cluster.pools
    terms: list[tuple[float, cp_model.IntVar]] = []
    total = 0.0
    for i, p in enumerate(pools):
        g = p.gpus_per_machine
        (s_i, u_i), top_i = steps[i], limits[i] // steps[i][1]
        intra = g * (g - 1) / 2 * p.intra_machine_gb_per_s
        terms.append((intra * u_i, s_i))
        total += intra * limits[i]
        for j in range(i, len(pools)):
            q = pools[j]
            (s_j, u_j), top_j = steps[j], limits[j] // steps[j][1]
            if i == j:
                # C(t, 2) * g^2 * beta = (t^2 - t) / 2 * g^2 * beta, with t = u * s
                weight = g * g * cluster.link_gb_per_s(p.name, p.name) / 2
                square = _product(model, s_i, s_i, top_i * top_i, f"tt_{p.name}")
                terms += [(weight * u_i * u_i, square), (-weight * u_i, s_i)]
                total += weight * (limits[i] * limits[i] - limits[i])
            else:
                weight = g * q.gpus_per_machine * cluster.link_gb_per_s(p.name, q.name)
                cross = _product(model, s_i, s_j, top_i * top_j, f"tt_{p.name}_{q.name}")
                terms.append((weight * u_i * u_j, cross))
                total += weight * limits[i] * limits[j]
    return terms, max(total, 1e-9)


def _product(model: cp_model.CpModel, a, b, bound: int, name: str) -> cp_model.IntVar:
    var = model.new_int_var(0, bound, name)
    model.add_multiplication_equality(var, [a, b])
    return var
