"""Why the plan is what it is: what limits it and why each pool got its role, as fields and in plain words."""

from __future__ import annotations

from areal_hex_plugin.plan import Binding, Machine, Objective, PoolRole
from areal_hex_plugin.planner.evaluate import Evaluation
from areal_hex_plugin.specs.cluster import Cluster

SYNC_SHARE = 0.1  # weight sync binds when it takes more than this share of the step


def binding_constraint(e: Evaluation, objective: Objective, cluster: Cluster) -> Binding:
    """Every limit on the chosen plan's throughput, the slower side of the step first."""
    slower = "train" if e.train_s > e.rollout_s else "rollout"
    limits = [slower]
    sync_per_step = e.sync_s / e.window
    if sync_per_step > SYNC_SHARE * e.step_s:
        limits.append("weight_sync")
    left = None
    if objective.kind == "budget":
        left = objective.budget_per_hour - e.cost_per_hour
        if left < min(p.price_per_machine_hour for p in cluster.pools):
            limits.append("budget")
    if objective.kind == "target":
        limits.append("target")
    idle = sum(p.machines - e.split.machines(i) for i, p in enumerate(cluster.pools))
    if objective.kind == "max_throughput" and idle == 0:
        limits.append("inventory")
    return Binding(slower, limits, e.train_s, e.rollout_s, sync_per_step, left, e.sync_s, e.window)


def describe_binding(b: Binding, objective: Objective) -> str:
    """The binding constraint in one sentence."""
    if b.slower == "train":
        parts = [f"training ({b.train_s:.1f}s) is slower than rollout ({b.rollout_s:.1f}s incl. reward)"]
    else:
        parts = [f"rollout ({b.rollout_s:.1f}s incl. reward) is slower than training ({b.train_s:.1f}s)"]
    step = b.sync_s + max(b.train_s, b.rollout_s)
    if "weight_sync" in b.limits:
        every = (
            f"{b.sync_update_s:.1f}s per update every {b.window_steps} steps, " if b.window_steps > 1 else ""
        )
        parts.append(
            f"weight sync takes {every}{b.sync_s:.1f}s per step ({100 * b.sync_s / step:.0f}% of the step)"
        )
    if "budget" in b.limits:
        parts.append(
            f"the ${objective.budget_per_hour:,.2f}/h budget (${b.budget_left_per_hour:,.2f}/h left, under one machine)"
        )
    if "target" in b.limits:
        parts.append(f"the cheapest plan reaching {objective.target_tokens_per_s:,.0f} tokens/s")
    if "inventory" in b.limits:
        parts.append("the inventory (every machine is in use)")
    return "; ".join(parts)


def pool_roles(machines: list[Machine], cluster: Cluster, limits: tuple[int, ...]) -> dict[str, PoolRole]:
    """Per pool: its placed machines per role (as the plan's machine table shows them: a search's shared machine
    whose training GPUs the layout leaves unused generates only), and the hardware figure that explains it."""
    used = [p for p, m in zip(cluster.pools, limits, strict=True) if m]
    best_flops = max(used, key=lambda p: p.gpu.tflops_bf16 / p.price_per_gpu_hour)
    best_hbm = max(used, key=lambda p: p.gpu.hbm_tb_per_s / p.price_per_gpu_hour)
    roles: dict[str, PoolRole] = {}
    for pool, limit in zip(cluster.pools, limits, strict=True):
        placed = [m.role for m in machines if m.pool == pool.name]
        t, r, split = placed.count("train"), placed.count("rollout"), placed.count("split")
        if split or (t and r):
            reason, best = "shared", False
        elif t:
            reason, best = "compute_bound", pool is best_flops
        elif r:
            reason, best = "hbm_bound", pool is best_hbm
        else:
            reason, best = ("outside_search" if limit == 0 else "no_gain"), False
        roles[pool.name] = PoolRole(
            t,
            r,
            placed.count("idle"),
            reason,
            best,
            pool.gpu.tflops_bf16 / pool.price_per_gpu_hour,
            pool.gpu.hbm_tb_per_s / pool.price_per_gpu_hour,
            split,
        )
    return roles


_WHY = {
    "compute_bound": ("training is compute-bound", ": best TFLOPS per $"),
    "hbm_bound": ("rollout is HBM-bound", ": best HBM bandwidth per $"),
    "shared": ("shared: training and rollout balanced on this type", ""),
    "outside_search": ("outside this search", ""),
    "no_gain": ("idle: a machine more would not raise throughput within the objective", ""),
}


def describe_role(role: PoolRole) -> str:
    """A pool's role in words: its machines per role, its figures per $, and why."""
    counts = ", ".join(
        f"{n} {what}"
        for n, what in (
            (role.train, "train"),
            (role.rollout, "rollout"),
            (role.split, "split between training and rollout"),
            (role.idle, "idle"),
        )
        if n
    )
    figures = f"{role.tflops_per_dollar:.0f} TFLOPS/$, {role.hbm_tb_per_s_per_dollar:.2f} TB/s HBM per $"
    why, best = _WHY[role.reason]
    return f"{counts} ({figures}); {why}{best if role.best_per_dollar else ''}"
