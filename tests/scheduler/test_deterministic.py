"""Issue 14, item 2: the plan does not depend on how busy the machine is (CPU-time limits, deterministic CP-SAT
work limits), only on the recipe."""

from __future__ import annotations

import time

from areal_hex_plugin.scheduler.planner import PlanRequest, plan_recipe
from tests.scheduler.helpers import recipe_with_pools


def test_a_crawling_wall_clock_gives_the_same_plan(monkeypatch):
    recipe = recipe_with_pools([("H800-PCIe", 8, 2), ("H20", 8, 4)], "7b", "hex.solver.time_limit_s=20")
    calm = plan_recipe(recipe, PlanRequest(budget_per_hour=80.0))
    real = time.monotonic
    ticks = iter(range(10**9))
    # Every reading of the wall clock is a minute later than the last, as on a machine shared by many jobs.
    monkeypatch.setattr(time, "monotonic", lambda: real() + 60.0 * next(ticks))
    busy = plan_recipe(recipe, PlanRequest(budget_per_hour=80.0))
    assert busy.solver.status == calm.solver.status != "timeout"
    assert busy.machines == calm.machines and busy.predicted == calm.predicted
