"""Megatron's layouts (every stage one dp and tp) on the paper's 56-GPU equal-budget mix of 4 H800 + 52 H20 (7B).

The pipeline order matters: the last stage also computes the LM head (152k x 3,584), so on a slow type it sets the
step. With one dp and tp for all stages, more stages is the only way to train on more of a pool's GPUs. The
search enumerated equal-stage layouts with the faster type first and at most ALL_DEPTHS stages unless memory
forced more, and kept 4 H800 alone (622.6 s) where 6 H20 stages then the H800 stage take 504.1 s.
"""

from __future__ import annotations

from itertools import permutations

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.costmodel.train import TrainStage
from areal_hex_plugin.planner.train_search import _equal_combinations, search_train
from areal_hex_plugin.sim.reproduce import H20, H800, rented
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO


def _mix():
    recipe = rented(load_recipe(REPO / "recipes/paper/7b.yaml", []), {H800: 4, H20: 52})
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    return recipe, cm


def test_h20_stages_before_the_h800_stage_train_faster_than_the_h800_alone():
    recipe, cm = _mix()
    alone = cm.train((TrainStage("h800-part", 4, 1),))
    mixed = cm.train((TrainStage("h20", 1, 4),) * 6 + (TrainStage("h800-part", 1, 4),))
    assert alone.feasible and mixed.feasible
    assert mixed.step_time_s < 0.85 * alone.step_time_s  # 504.1 s against 622.6 s
    # The same stages with the H800 first leave the LM head on an H20 stage: slower than the H800 alone.
    reversed_ = cm.train((TrainStage("h800-part", 1, 4),) + (TrainStage("h20", 1, 4),) * 6)
    assert reversed_.step_time_s > alone.step_time_s


def test_the_equal_stage_search_finds_the_mixed_pipeline():
    recipe, cm = _mix()
    mixed = cm.train((TrainStage("h20", 1, 4),) * 6 + (TrainStage("h800-part", 1, 4),))
    gpus = {"h800-part": 4, "h20": 48}
    for exhaustive in (False, True):
        found = search_train(cm, recipe.cluster, gpus, 28, exhaustive=exhaustive, equal_stages=True)
        assert len({(s.dp, s.tp) for s in found.stages}) == 1
        assert found.step_time_s <= mixed.step_time_s + 1e-9, exhaustive


def test_equal_combinations_come_in_every_pool_order_once():
    recipe, _ = _mix()
    pools = [recipe.cluster.pool("h800-part"), recipe.cluster.pool("h20")]
    combos = list(_equal_combinations(pools, {"h800-part": 4, "h20": 48}, 4))
    assert len(combos) == len(set(combos))
    orders = {tuple(o.pool for o in c) for c in combos if len(c) == 2}
    assert orders == set(permutations(("h800-part", "h20")))
