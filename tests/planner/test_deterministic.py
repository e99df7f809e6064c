"""Issue 14, item 2: the plan does not depend on how fast or busy the machine is (the search's clock counts work:
CP-SAT deterministic time and cost-model estimates), only on the recipe."""

from __future__ import annotations

import time

from areal_hex_plugin.planner.recipe_planner import PlanRequest, plan_recipe
from tests.planner.helpers import recipe_with_pools


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


def test_a_slow_processor_gives_the_same_plan_even_when_the_limit_stops_the_search(monkeypatch):
    """The search's clock counts work (CP-SAT deterministic time, cost-model estimates), not CPU seconds: a limit
    that stops the search stops it at the same point on a slow or busy processor."""
    recipe = recipe_with_pools([("H800-PCIe", 8, 4), ("H20", 8, 9)], "7b", "hex.solver.time_limit_s=0.3")
    fast = plan_recipe(recipe)
    real = time.process_time
    ticks = iter(range(10**9))
    # Every reading of the CPU clock is a minute later than the last, as on a processor a hundred times slower.
    monkeypatch.setattr(time, "process_time", lambda: real() + 60.0 * next(ticks))
    slow = plan_recipe(recipe)
    assert fast.solver.status == slow.solver.status == "timeout"
    assert slow.machines == fast.machines and slow.predicted == fast.predicted
