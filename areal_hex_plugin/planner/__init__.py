"""The two-phase heterogeneity-aware scheduler: phase 1 (training search, rollout CP-SAT), phase 2 (Eq. (3)
repartition CP-SAT) in a gamma-bisection / EM loop, plus exhaustive mode, objectives and baselines."""

from areal_hex_plugin.planner.recipe_planner import PlanRequest, plan_recipe

__all__ = ["PlanRequest", "plan_recipe"]
