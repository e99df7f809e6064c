"""Issue 26, item 1: roles inside a machine. The review: one 8xH100 machine with Qwen2.5-0.5B failed with "fits no
split... add machines or GPUs with more memory", where upstream runs such a machine as ``sglang.d4+fsdp.d4``."""

from __future__ import annotations

import pytest

from areal_hex_plugin.areal.worker_slots import placement_from_plan
from areal_hex_plugin.costmodel import RolloutStage
from areal_hex_plugin.plan import HexPlan, check_plan_fits
from areal_hex_plugin.planner.caps import caps_for, unmet
from areal_hex_plugin.planner.recipe_planner import Planner, PlanRequest, plan_recipe
from areal_hex_plugin.planner.search import THROUGHPUT_TIE
from areal_hex_plugin.planner.split import Split, shared_choices, shared_splits
from areal_hex_plugin.sim.inputs import sim_spec
from areal_hex_plugin.specs.cluster import SHARED_MACHINES
from tests.planner.helpers import BRUTE_DEPTH, recipe_with_pools

ONE_H100 = [("H100", 8, 1)]


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"])
def test_one_8_gpu_machine_plans_split_between_the_roles(model):
    recipe = recipe_with_pools(ONE_H100, "1.5b", f"actor.path={model}")
    plan = plan_recipe(recipe)
    (machine,) = plan.machines
    assert machine.role == "split" and machine.host == "p0-0"
    train = [g.gpu for g in machine.gpus if g.role == "train"]
    serve = [g.gpu for g in machine.gpus if g.role == "rollout"]
    assert train and serve and sorted(train + serve) == list(range(8))
    assert plan.predicted.tokens_per_s > 0 and plan.predicted.cost_per_hour == pytest.approx(
        recipe.cluster.pools[0].price_per_machine_hour
    )
    # The plan reads back, fits its recipe and gives upstream one worker per GPU of each role on that host.
    again = HexPlan.from_dict(plan.to_dict())
    check_plan_fits(again, recipe.cluster, recipe.workload.model)
    placement = placement_from_plan(again)
    actors, servers = placement.slots["actor"], placement.slots["rollout"]
    assert sorted(i for s in actors for i in s.gpu_ids) == sorted(train)
    assert sorted(i for s in servers for i in s.gpu_ids) == sorted(serve)
    assert {s.host for s in actors + servers} == {"p0-0"}
    assert unmet(plan, caps_for("fsdp", "relay", "xccl")) == {}
    # The simulator prices the weights' way to the split machine's servers as the plan does.
    sync = sim_spec(recipe, again).sync_s / again.solver.window_steps
    assert sync == pytest.approx(plan.predicted.weight_sync_s, abs=1e-4)


def test_the_two_phase_search_finds_the_brute_forces_split_plans():
    """Both spaces hold the same shared splits (the brute force shares none of the search's pruning)."""
    for pools, model in (
        (ONE_H100, "1.5b"),
        ([("H100", 8, 1), ("L40S", 4, 2)], "1.5b"),
        ([("A100-80GB", 4, 2)], "7b"),
    ):
        recipe = recipe_with_pools(pools, model, BRUTE_DEPTH)
        search = plan_recipe(recipe)
        brute = plan_recipe(recipe, PlanRequest(exhaustive=True))
        assert search.predicted.tokens_per_s >= (1 - 0.01) * brute.predicted.tokens_per_s, pools
        assert brute.predicted.tokens_per_s >= (1 - THROUGHPUT_TIE) * search.predicted.tokens_per_s, pools


def test_a_split_machine_gets_its_weights_over_its_gpu_links():
    planner = Planner(recipe_with_pools([("H100", 8, 2)], "7b"), PlanRequest())
    cm = planner.cm
    senders = {"p0": cm.workload.model.weight_bytes()}
    beside = cm.weight_sync(senders, [], strategy="relay", colocated=("p0",)).seconds
    remote = cm.weight_sync(senders, [((RolloutStage("p0", 4),), 1)], strategy="relay").seconds
    assert 0 < beside < remote


def test_splits_are_searched_on_small_inventories_only():
    small = recipe_with_pools([("H100", 8, 1), ("L40S", 4, 2)])
    assert shared_choices(small.cluster, (1, 2)) == ((2, 4, 6), (1, 2, 3))
    # Nothing to enumerate on a large inventory, at once (1,024 GPUs of 4 pools: no product of their splits).
    assert list(shared_splits((32, 32, 32, 32), ((),) * 4)) == []
    big = recipe_with_pools([("H100", 8, SHARED_MACHINES + 1)])
    assert shared_choices(big.cluster, (SHARED_MACHINES + 1,)) == ((),)
    plan = plan_recipe(big)
    assert all(m.role != "split" for m in plan.machines)


def test_a_split_is_priced_as_the_machine_it_rents():
    cluster = recipe_with_pools([("H100", 8, 3)]).cluster
    split = Split((1,), (1,), (4,))
    assert split.cost_per_hour(cluster) == pytest.approx(3 * cluster.pools[0].price_per_machine_hour)
    assert split.train_gpus(cluster) == (12,) and split.colocated_gpus(cluster) == (4,)
    assert Split((1,), (1,), (0,)) == Split((1,), (1,))


@pytest.mark.parametrize("budget", [None, 40.0])
def test_split_plans_are_monotone_in_eta_and_budget(budget):
    extra = [] if budget is None else [f"hex.objective.budget_per_hour={budget}"]
    rates = []
    for eta in (1, 2, 4, 8):
        recipe = recipe_with_pools(
            [("H100", 8, 1), ("L40S", 4, 2)], "1.5b", f"rollout.max_head_offpolicyness={eta}", *extra
        )
        rates.append(plan_recipe(recipe).predicted.tokens_per_s)
    assert all(b >= (1 - THROUGHPUT_TIE) * a for a, b in zip(rates, rates[1:], strict=False)), rates
    budgets = []
    for level in (25.0, 35.0, 45.0, 60.0):
        recipe = recipe_with_pools(
            [("H100", 8, 1), ("L40S", 4, 2)], "1.5b", f"hex.objective.budget_per_hour={level}"
        )
        budgets.append(plan_recipe(recipe).predicted.tokens_per_s)
    assert all(b >= (1 - THROUGHPUT_TIE) * a for a, b in zip(budgets, budgets[1:], strict=False)), budgets


def test_hex_slurm_does_not_split_machines():
    recipe = recipe_with_pools(ONE_H100, "1.5b", "actor.path=Qwen/Qwen2.5-0.5B")
    split_plan = plan_recipe(recipe)
    slurm = caps_for("fsdp", "relay", "xccl", "hex_slurm")
    assert "split machines" in unmet(split_plan, slurm)
    two = recipe_with_pools([("H100", 8, 2)], "1.5b", "actor.path=Qwen/Qwen2.5-0.5B")
    plan = plan_recipe(two, PlanRequest(caps=slurm))
    assert all(m.role != "split" for m in plan.machines) and unmet(plan, slurm) == {}


@pytest.mark.parametrize(
    "pools",
    [ONE_H100, [("H100", 4, 2), ("H20", 4, 1)]],
    ids=["one-machine-split", "shared-gpu-unused-by-training"],
)
def test_each_pools_why_counts_the_machines_of_its_table(pools):
    """Found by a scale check: a pool's "why" (``pool_role_reasons``, ``pool_roles``) counted the split the search
    scored, not the machines placed. On 2 4-GPU H100s and an H20 the split shares p0-1, but its training GPU is
    not in the dp4 training layout: the table shows p0-1 generating only, the why said "1 split"."""
    plan = plan_recipe(recipe_with_pools(pools, "1.5b", "actor.path=Qwen/Qwen2.5-0.5B"))
    for pool, role in plan.pool_role_reasons.items():
        table = [m.role for m in plan.machines if m.pool == pool]
        said = {"train": role.train, "rollout": role.rollout, "idle": role.idle, "split": role.split}
        assert said == {r: table.count(r) for r in said}, (pool, table, role)
        assert (role.reason == "shared") == ("split" in table or {"train", "rollout"} <= set(table)), role
        if "split" in table:
            assert plan.pool_roles[pool].startswith(
                f"{table.count('split')} split between training and rollout"
            )
