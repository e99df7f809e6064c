"""Upstream deals a step's samples out evenly over the training DP ranks: no plan trains on a dp that does not
divide them (the one-machine recipe planned dp3 for 16 samples, and upstream's first training step failed)."""

from __future__ import annotations

import dataclasses

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.costmodel.train import TrainStage
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.planner.train_search import search_train
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO

RECIPE = REPO / "recipes/ci/one_machine.yaml"


def test_a_dp_that_does_not_divide_the_samples_is_refused_with_the_reason():
    recipe = load_recipe(RECIPE, [])
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    samples = recipe.workload.rl.samples_per_step
    assert samples % 3 and not samples % 2
    pool = recipe.cluster.pools[0].name
    assert cm.train((TrainStage(pool, 2, 1),)).feasible
    refused = cm.train((TrainStage(pool, 3, 1),))
    assert not refused.feasible and f"dp=3 does not divide the step's {samples} samples" in refused.reason


def test_the_search_takes_the_largest_dp_that_divides_the_samples():
    recipe = load_recipe(RECIPE, [])
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    pool = recipe.cluster.pools[0].name
    chosen = search_train(cm, recipe.cluster, {pool: 7}, max_pp=1)
    assert [s.dp * s.tp for s in chosen.stages] == [4]  # 7 GPUs: dp4 (16 samples), not dp7
    # A measured run of another runtime is not held to the rule.
    loose = dataclasses.replace(
        recipe.workload, rl=dataclasses.replace(recipe.workload.rl, even_dispatch=False)
    )
    assert CostModel(recipe.cluster, loose, recipe.calibration).train((TrainStage(pool, 3, 1),)).feasible


def test_every_plan_of_the_one_machine_recipe_divides_its_samples():
    recipe = load_recipe(RECIPE, [])
    plan = plan_recipe(recipe)
    assert all(recipe.workload.rl.samples_per_step % s.dp == 0 for s in plan.train.stages)
