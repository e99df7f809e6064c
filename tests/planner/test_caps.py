"""RuntimeCaps constrain the search itself: what the recipe's backends cannot start is never planned."""

from __future__ import annotations

import dataclasses

import pytest

from areal_hex_plugin.costmodel.memory import GB, USABLE_HBM_FRACTION, megatron_state_bytes, stage_params
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.planner import PlanRequest, plan_recipe
from areal_hex_plugin.planner.caps import PAPER, caps_for, recipe_caps, unmet
from areal_hex_plugin.planner.train_search import _equal_combinations, tp_degrees
from areal_hex_plugin.specs.recipe import load_recipe
from benchmarks.clusters import pools_override
from tests.conftest import REPO
from tests.planner.helpers import recipe_with_pools

# A mix where the paper's plan pipelines training over both types, with the generic factors (the paper fit makes
# H20 training slow enough that no plan trains on it: see costmodel/profiles/paper.json).
MIX = [("H800-PCIe", 8, 1), ("H20", 8, 4)]


@pytest.fixture(scope="module")
def plans():
    recipe = recipe_with_pools(MIX, "14b", "hex.solver.time_limit_s=20", "hex.calibration.profile=null")
    return (
        recipe,
        plan_recipe(recipe),
        plan_recipe(recipe, PlanRequest(caps=PAPER)),
        plan_recipe(recipe, PlanRequest(caps=caps_for("megatron", "upstream", "disk"))),
    )


def test_fsdp_recipe_plans_one_stage_on_one_type_and_servers_inside_a_machine(plans) -> None:
    recipe, fsdp, _, _ = plans
    assert recipe_caps(recipe).name == "fsdp" and fsdp.runtime.startswith("fsdp + sglang")
    assert len(fsdp.train.stages) == 1
    assert all(g.tp * g.pp in tp_degrees(8) for g in fsdp.rollout.replicas)
    assert unmet(fsdp, recipe_caps(recipe)) == {}


def test_the_paper_space_is_wider_and_its_plan_names_what_fsdp_lacks(plans) -> None:
    recipe, fsdp, paper, _ = plans
    assert paper.predicted.tokens_per_s >= fsdp.predicted.tokens_per_s
    assert len(paper.train.stages) > 1 and "training stages" in unmet(paper, recipe_caps(recipe))


def test_hybrid_sharding_is_the_paper_spaces_only_with_the_reason(plans) -> None:
    recipe, fsdp, _, megatron = plans
    stage = dataclasses.replace(fsdp.train.stages[0], hybrid=True)
    hybrid = dataclasses.replace(fsdp, train=dataclasses.replace(fsdp.train, stages=[stage]))
    reason = unmet(hybrid, recipe_caps(recipe))["hybrid sharding"]
    assert "one dp mesh" in reason and "replicate" in reason
    assert unmet(hybrid, PAPER) == {}
    assert not any(s.hybrid for s in (*fsdp.train.stages, *megatron.train.stages))


def test_megatron_stages_share_dp_and_tp(plans) -> None:
    recipe, _, _, megatron = plans
    assert len({(s.dp, s.tp) for s in megatron.train.stages}) == 1
    assert megatron.runtime.startswith("megatron")
    # The layouts Megatron's search enumerates: one dp and tp, stages on both GPU types among them.
    pools = [recipe.cluster.pool("p0"), recipe.cluster.pool("p1")]
    combos = list(_equal_combinations(pools, {"p0": 8, "p1": 32}, 4))
    assert all(len({(o.dp, o.tp) for o in c}) == 1 for c in combos)
    assert any({o.pool for o in c} == {"p0", "p1"} for c in combos)
    assert all(sum(o.k for o in c) <= 4 and all(o.k * o.dp * o.tp <= (8 if o.pool == "p0" else 32) for o in c)
               for c in combos)  # fmt: skip


def test_one_layout_runtimes_plan_one_rollout_layout() -> None:
    recipe = recipe_with_pools([("H800-PCIe", 8, 1), ("H20", 8, 2)], "1.5b", "hex.solver.time_limit_s=5")
    plan = plan_recipe(recipe, PlanRequest(caps=caps_for("fsdp", "upstream", "xccl")))
    assert len({(g.tp, g.pp) for g in plan.rollout.replicas}) == 1


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_unsupported_weight_paths_are_refused_with_the_fix(backend) -> None:
    with pytest.raises(HexError) as err:
        caps_for(backend, "upstream", "awex")
    assert err.value.field == "actor.weight_update_mode" and err.value.fix


def test_the_relay_sends_from_either_backend_whatever_the_rollout_pipelines() -> None:
    for backend in ("fsdp", "megatron"):
        caps = caps_for(backend, "relay", "xccl")
        assert caps.weight_path == "relay" and caps.max_rollout_pp is None and not caps.one_rollout_layout


def test_slurm_plans_one_rollout_layout_per_pool() -> None:
    from areal_hex_plugin.planner.recipe_planner import Planner

    recipe = recipe_with_pools([("H20", 8, 3)], "7b", "scheduler.type=hex_slurm")
    caps = recipe_caps(recipe)
    assert caps.one_layout_per_pool and "hex_slurm" in caps.describe()
    slurm, free = Planner(recipe, PlanRequest()).ev, Planner(recipe, PlanRequest(caps=PAPER)).ev
    for machines in (1, 2, 3):
        one, many = slurm.pool_fleet("p0", machines), free.pool_fleet("p0", machines)
        assert len(one.counts) <= 1 and one.tokens_per_s <= many.tokens_per_s + 1e-9
    plan = plan_recipe(recipe)
    assert len({(g.tp, g.pp) for g in plan.rollout.replicas}) <= 1 and unmet(plan, caps) == {}
    two = [
        plan.rollout.replicas[0],
        dataclasses.replace(plan.rollout.replicas[0], tp=plan.rollout.replicas[0].tp * 2),
    ]
    mixed = dataclasses.replace(plan, rollout=dataclasses.replace(plan.rollout, replicas=two))
    assert "p0" in unmet(mixed, caps)["rollout layouts per pool"]


def test_a_megatron_recipe_never_gets_a_one_stage_layout_whose_state_does_not_fit() -> None:
    """32B on 256 H100s with a fast network: FSDP-style costing (56 GB per GPU) made ``megatron:d128p1t1`` the plan;
    Megatron keeps about 6 bytes per parameter on every rank (~200 GB), so the plan must split the model."""
    cluster = pools_override(
        [{"gpu_type": "H100", "gpus_per_machine": 8, "machines": 32, "inter_machine_gb_per_s": 50}]
    )
    recipe = load_recipe(
        REPO / "recipes" / "paper" / "14b.yaml",
        [cluster, "hex.objective.budget_per_hour=null", "++hex.workload.model=Qwen2.5-32B",
         "actor.backend=megatron:d8p1t1", "hex.solver.time_limit_s=10"],
    )  # fmt: skip
    plan = plan_recipe(recipe)
    model, stages = recipe.workload.model, plan.train.stages
    params = stage_params(model, tuple(s.layers for s in stages))
    state = max(
        megatron_state_bytes(p, model, s.layers, s.dp, s.tp) / GB for p, s in zip(params, stages, strict=True)
    )
    assert state <= plan.train.memory_gb_per_gpu <= USABLE_HBM_FRACTION * 80
