"""A saved plan used with a recipe (``simulate --plan``, ``hex.plan_path``): checked against the recipe's cluster and
model, and against its budget at the recipe's prices."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.plan import HexPlan, load_plan_for


def plan_cost_per_hour(plan: HexPlan, cluster) -> float:
    """What the plan's machines cost per hour at the cluster's prices: every machine with a GPU at work."""
    price = {p.name: p.price_per_machine_hour for p in cluster.pools}
    return sum(price[m.pool] for m in plan.machines if any(g.role != "idle" for g in m.gpus))


def check_plan_budget(plan: HexPlan, recipe, path: str | Path, field: str) -> None:
    """Refuse a plan that costs more than ``hex.objective.budget_per_hour`` at the recipe's prices."""
    budget = recipe.hex.objective.budget_per_hour
    if budget is None:
        return
    cost = plan_cost_per_hour(plan, recipe.cluster)
    if cost > budget * (1 + 1e-9):
        raise HexError(
            field,
            f"the plan at {path} costs ${cost:,.2f}/h at the recipe's prices, over its budget "
            f"(hex.objective.budget_per_hour={budget:g})",
            f"re-plan within the budget: areal-hex plan RECIPE --json {path}; or raise the budget to "
            f"hex.objective.budget_per_hour={math.ceil(cost * 100) / 100:g}",
        )


def load_saved_plan(path: str | Path, recipe, field: str) -> HexPlan:
    """The plan at ``path``, checked against ``recipe``: its cluster, its model and its budget; without the
    planner's explanations of it (:func:`without_explanations`)."""
    plan = load_plan_for(path, recipe.cluster, recipe.workload.model, field)
    check_plan_budget(plan, recipe, path, field)
    return without_explanations(plan)


def without_explanations(plan: HexPlan) -> HexPlan:
    """``plan`` without what only the planner's search knows (why each pool got its role, the binding constraint,
    the frontier and its alternatives, the sensitivity): a file's copy of them is not checked, so not shown."""
    return dataclasses.replace(
        plan,
        binding="",
        binding_constraint=None,
        pool_roles={},
        pool_role_reasons={},
        pareto=[],
        alternatives={},
        sensitivity=None,
    )
