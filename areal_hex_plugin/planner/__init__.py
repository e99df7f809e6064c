"""The two-phase heterogeneity-aware scheduler: phase 1 (training search, rollout CP-SAT), phase 2 (Eq. (3)
repartition CP-SAT) in a gamma-bisection / EM loop, plus exhaustive mode, objectives and baselines.

Imports are lazy: ``from areal_hex_plugin.planner import plan_recipe`` loads the solvers (OR-Tools, which imports
pandas) only then, so a module that needs only the planner's data (``planner.caps``, for a rollout worker) does not.
"""

from __future__ import annotations

from areal_hex_plugin.lazy_exports import lazy_exports

_EXPORTS = {"PlanRequest": "recipe_planner", "plan_recipe": "recipe_planner"}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
