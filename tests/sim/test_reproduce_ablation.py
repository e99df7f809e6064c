"""The ablation "AReaL (u)" is an even GPU split between rollout and training, against the planner's split."""

from __future__ import annotations

import pytest

from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.sim.reproduce import even_split, paper_request, rented
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO


@pytest.mark.slow
def test_even_split_trains_on_half_and_loses_to_the_planned_split():
    recipe = rented(load_recipe(REPO / "recipes/paper/7b.yaml"), {"H800-PCIe": 24}, "upstream")
    uniform = even_split(recipe)
    plan = plan_recipe(recipe, paper_request(recipe))
    # At eta = 8 and the plan's own admission, training (MFU 0.16 fitted to the paper's runs) is the longer phase:
    # the plan trains on two machines and generates on one.
    assert plan.train.gpus == {"H800-PCIe": 16} and plan.rollout.gpus == {"H800-PCIe": 8}
    # Twelve GPUs train slower than the plan's sixteen, and the even split's step is its training (weights every
    # step, its in-flight caps as the planner chooses them: twelve generating keep up).
    assert uniform["train_s"] > plan.predicted.train_time_s
    step = recipe.workload.tokens_per_step / uniform["tokens_per_s"]
    assert step == pytest.approx(uniform["train_s"] + uniform["weight_sync_s"])
    assert uniform["tokens_per_s"] < plan.predicted.tokens_per_s
