"""A saved plan used with a recipe (``simulate --plan``, ``hex.plan_path``): checked against the recipe's cluster and
model, against its budget at the recipe's prices, and its layouts by the cost model.

The planner only builds layouts the cost model finds feasible (the TP degree divides the attention heads, the
weights leave room for a KV cache, the training state fits); a plan read from a file, perhaps edited by hand,
passes the same check (:func:`plan_estimates`) before anything uses it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from areal_hex_plugin.costmodel.model import CostModel
from areal_hex_plugin.costmodel.rollout import RolloutEstimate, RolloutStage
from areal_hex_plugin.costmodel.train import TrainEstimate, TrainStage
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


def obtain_plan(recipe, plan_path: str | None) -> tuple[HexPlan, str]:
    """The plan a run follows, and where it came from: the saved plan at ``plan_path`` (``hex.plan_path``: checked
    against the recipe and its budget, and its layouts by the cost model as the planner's own are), or, with no
    path, the plan ``areal-hex plan RECIPE`` shows, solved now."""
    if not plan_path:
        from areal_hex_plugin.planner import plan_recipe

        plan = plan_recipe(recipe)
        return plan, f"solved at start for {plan.runtime}"
    plan = load_saved_plan(plan_path, recipe, "hex.plan_path")
    plan_estimates(CostModel(recipe.cluster, recipe.workload, recipe.calibration), plan)
    return plan, f"plan {plan_path}"


def plan_estimates(
    cm: CostModel, plan: HexPlan, source: str = "plan"
) -> tuple[list[RolloutEstimate], TrainEstimate]:
    """Each replica group's estimate (its full batch) and the training layout's; HexError names the first
    group or the trainer that does not run, and why."""
    rollout = []
    for i, group in enumerate(plan.rollout.replicas):
        estimate = cm.rollout(tuple(RolloutStage(pool=group.pool, tp=group.tp) for _ in range(group.pp)))
        if not estimate.feasible:
            raise HexError(
                f"{source}.rollout.replicas[{i}]",
                f"tp{group.tp} pp{group.pp} on {group.gpu_type} does not run on this recipe: {estimate.reason}",
                "re-plan the recipe (areal-hex plan RECIPE --json PLAN), or edit the group to a layout that runs",
            )
        rollout.append(estimate)
    train = cm.train(tuple(TrainStage(s.pool, s.dp, s.tp, s.hybrid) for s in plan.train.stages))
    if not train.feasible:
        raise HexError(
            f"{source}.train", f"does not run on this recipe: {train.reason}", "re-plan the recipe"
        )
    return rollout, train
