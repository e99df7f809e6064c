"""Recipes for scheduler tests: a shipped paper recipe with its cluster replaced through ordinary overrides."""

from __future__ import annotations

from areal_hex_plugin.planner.brute import LIMITS
from areal_hex_plugin.specs.recipe import load_recipe
from benchmarks.clusters import pools_override
from tests.conftest import REPO

# The brute force enumerates pipelines of at most this many stages: recipes it solves bound the depth (the
# default is as deep as the model allows).
BRUTE_DEPTH = f"+hex.solver.max_pp_stages={LIMITS['hex.solver.max_pp_stages']}"


def recipe_with_pools(pools: list[tuple[str, int, int]], model: str = "1.5b", *extra: str):
    """``pools``: (GPU type, GPUs per machine, machines), priced as the benchmarks price them; no budget unless
    ``extra`` sets one."""
    cluster = pools_override([{"gpu_type": t, "gpus_per_machine": g, "machines": m} for t, g, m in pools])
    overrides = [cluster, "hex.objective.budget_per_hour=null", *extra]
    return load_recipe(REPO / "recipes" / "paper" / f"{model}.yaml", overrides)
