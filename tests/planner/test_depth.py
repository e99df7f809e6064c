"""Pipelines as deep as the model allows (issue 14): hex.solver.max_pp_stages defaults to the model's decoder
layers, a user's bound still holds, and exhaustive mode names the bound it needs."""

from __future__ import annotations

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.planner.caps import recipe_caps, unmet
from areal_hex_plugin.planner.recipe_planner import plan_recipe
from tests.conftest import REPO
from tests.planner.helpers import BRUTE_DEPTH, recipe_with_pools

# 14B on 48 GB L40S machines: within 4 stages only tp 2 fits; 8 stages of tp 1 train faster (Megatron, runnable)
# where TP's all-reduces cross PCIe at the bottom of link_efficiency's range (at the default, 8 stages of tp 1 and
# 4 of tp 2 tie on 16 GPUs: 408.8 vs 407.5 s).
L40S = [("L40S", 8, 3), ("L40S", 8, 1)]
MEGATRON = "actor.backend=megatron:d8"
SLOW_TP = "++hex.calibration.gpu_types.L40S.link_efficiency=0.3"


def test_the_default_depth_is_the_models_and_a_users_bound_holds():
    assert recipe_with_pools(L40S, "14b").solver.max_pp_stages == 48
    assert recipe_with_pools(L40S, "14b", "+hex.solver.max_pp_stages=6").solver.max_pp_stages == 6
    assert recipe_with_pools(L40S, "1.5b", "+hex.solver.max_pp_stages=100").solver.max_pp_stages == 28


def test_a_pipeline_deeper_than_four_stages_wins_and_the_default_finds_it():
    deep = plan_recipe(recipe_with_pools(L40S, "14b", MEGATRON, SLOW_TP))
    bounded = plan_recipe(recipe_with_pools(L40S, "14b", MEGATRON, SLOW_TP, BRUTE_DEPTH))
    assert len(deep.train.stages) > 4 >= len(bounded.train.stages)
    # The deeper pipeline trains faster; its step is the rollout's (L40S decode from measured kernel data), so
    # tokens/s only has to be no lower.
    assert deep.predicted.train_time_s < bounded.predicted.train_time_s / 1.03
    assert deep.predicted.tokens_per_s >= bounded.predicted.tokens_per_s
    assert not unmet(deep, recipe_caps(recipe_with_pools(L40S, "14b", MEGATRON, SLOW_TP)))
    assert sum(s.layers for s in deep.train.stages) == 48


@pytest.mark.parametrize(("extra", "fix"), [((), "hex.solver.max_pp_stages=4"), ((BRUTE_DEPTH,), None)])
def test_exhaustive_mode_names_the_depth_bound_it_needs(capsys, extra, fix):
    pools = "hex.cluster.pools=[{name: a, gpu_type: H20, gpus_per_machine: 4, machines: 2, price_per_gpu_hour: 2}]"
    argv = [
        "plan",
        str(REPO / "recipes/paper/1.5b.yaml"),
        pools,
        "hex.objective.budget_per_hour=null",
        *extra,
    ]
    code = main([*argv, "--exhaustive"])
    err = capsys.readouterr().err
    if fix is None:
        assert code == 0, err
        return
    assert code == 2 and err.startswith("error: --exhaustive") and "Traceback" not in err
    assert "hex.solver.max_pp_stages is 28 (unset" in err and f"fix: append {fix} to the command" in err
