"""Plain-language reasons: what limits the chosen plan, and why each pool got its role."""

from __future__ import annotations

from areal_hex_plugin.plan import Objective
from areal_hex_plugin.scheduler.evaluate import Evaluation
from areal_hex_plugin.specs.cluster import Cluster


def binding_constraint(e: Evaluation, objective: Objective, cluster: Cluster) -> str:
    """The constraint that limits throughput, in one sentence."""
    if e.train_s > e.rollout_s:
        side = f"training ({e.train_s:.1f}s) is slower than rollout ({e.rollout_s:.1f}s incl. reward)"
    else:
        side = f"rollout ({e.rollout_s:.1f}s incl. reward) is slower than training ({e.train_s:.1f}s)"
    parts = [side]
    if e.sync_s > 0.1 * e.step_s:
        parts.append(f"weight sync takes {e.sync_s:.1f}s ({100 * e.sync_s / e.step_s:.0f}% of the step)")
    if objective.kind == "budget":
        cheapest = min(p.price_per_machine_hour for p in cluster.pools)
        left = objective.budget_per_hour - e.cost_per_hour
        if left < cheapest:
            parts.append(
                f"the ${objective.budget_per_hour:,.2f}/h budget (${left:,.2f}/h left, under one machine)"
            )
    if objective.kind == "target":
        parts.append(f"the cheapest plan reaching {objective.target_tokens_per_s:,.0f} tokens/s")
    idle = sum(
        p.machines - t - r for p, t, r in zip(cluster.pools, e.split.train, e.split.rollout, strict=True)
    )
    if objective.kind == "max_throughput" and idle == 0:
        parts.append("the inventory (every machine is in use)")
    return "; ".join(parts)


def pool_roles(e: Evaluation, cluster: Cluster, limits: tuple[int, ...]) -> dict[str, str]:
    """Per pool: its machines per role, and the hardware figure that explains the choice."""
    used = [p for p, m in zip(cluster.pools, limits, strict=True) if m]
    best_flops = max(used, key=lambda p: p.gpu.tflops_bf16 / p.price_per_gpu_hour)
    best_hbm = max(used, key=lambda p: p.gpu.hbm_tb_per_s / p.price_per_gpu_hour)
    roles: dict[str, str] = {}
    for pool, t, r in zip(cluster.pools, e.split.train, e.split.rollout, strict=True):
        idle = pool.machines - t - r
        counts = ", ".join(f"{n} {what}" for n, what in ((t, "train"), (r, "rollout"), (idle, "idle")) if n)
        flops = pool.gpu.tflops_bf16 / pool.price_per_gpu_hour
        hbm = pool.gpu.hbm_tb_per_s / pool.price_per_gpu_hour
        figures = f"{flops:.0f} TFLOPS/$, {hbm:.2f} TB/s HBM per $"
        if t and not r:
            why = "training is compute-bound" + (": best TFLOPS per $" if pool is best_flops else "")
        elif r and not t:
            why = "rollout is HBM-bound" + (": best HBM bandwidth per $" if pool is best_hbm else "")
        elif t and r:
            why = "shared: training and rollout balanced on this type"
        elif limits[cluster.pools.index(pool)] == 0:
            why = "outside this search"
        else:
            why = "idle: a machine more would not raise throughput within the objective"
        roles[pool.name] = f"{counts} ({figures}); {why}"
    return roles
