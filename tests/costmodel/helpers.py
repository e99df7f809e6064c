"""Recipes and cost models shared by the cost-model tests (loaded once: loading is pure)."""

from __future__ import annotations

from functools import cache

from areal_hex_plugin.costmodel import CostModel, recipe_calibration
from areal_hex_plugin.specs.recipe import Recipe, load_recipe
from tests.conftest import REPO


@cache
def recipe(name: str, *overrides: str) -> Recipe:
    return load_recipe(REPO / "recipes" / name, list(overrides))


def cost_model(name: str, *overrides: str) -> CostModel:
    r = recipe(name, *overrides)
    return CostModel(r.cluster, r.workload, recipe_calibration(r))
