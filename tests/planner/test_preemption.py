"""Preemptible pools: expected speeds checked by hand, training kept off them, and plans priced with losses."""

from __future__ import annotations

import math

import pytest

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.planner.preemption import Loss, Preemption
from areal_hex_plugin.planner.report import describe_plan
from areal_hex_plugin.planner.rollout_model import ReplicaConfig
from areal_hex_plugin.specs.catalog import build_catalog
from areal_hex_plugin.specs.cluster import Pool
from areal_hex_plugin.specs.recipe import load_recipe
from areal_hex_plugin.specs.workload import LengthDistribution
from tests.conftest import REPO

RECIPE = REPO / "recipes" / "paper" / "1.5b.yaml"
FAST = ["hex.objective.budget_per_hour=null", "hex.solver.time_limit_s=10"]


def spot(pool: int, per_hour: float = 1.0, recovery_s: float = 300.0) -> list[str]:
    key = f"+hex.cluster.pools.{pool}"
    return [
        f"{key}.preemptible=true",
        f"{key}.preemptions_per_hour={per_hour}",
        f"{key}.recovery_s={recovery_s}",
    ]


def _pool(per_hour: float, recovery_s: float) -> Pool:
    gpu = build_catalog({}).get("H20", "gpu_type")
    return Pool("spot", gpu, 8, 4, (), 1.0, 900.0, 5.0, per_hour, recovery_s)


def test_replica_expected_speed_by_hand():
    # Lengths 1000 and 3000: an in-flight sequence is (1000^2 + 3000^2) / (2 * 4000) = 1250 tokens old; 64 of
    # them on a 1000 tokens/s replica are W = 80 s of its work. lambda = 3.6/h = 0.001/s, R = 100 s:
    # (1 - 0.08) / (1 + 0.1).
    pre = Preemption({"spot": _pool(3.6, 100.0)}, False, LengthDistribution((1000, 3000), "test"))
    replica = ReplicaConfig("spot", 1, 1, 1000.0, 64)
    assert pre.replica_factor(replica) == pytest.approx(0.92 / 1.1)
    assert pre.replica_factor(ReplicaConfig("reliable", 1, 1, 1000.0, 64)) == 1.0
    # A fleet of one spot and one reliable replica of equal speed: the shares re-solved, rollout time grows by
    # loss-free speed / expected speed = 2 / (1 + 0.92 / 1.1).
    loss = pre.loss({}, ((replica, 1), (ReplicaConfig("reliable", 1, 1, 1000.0, 64), 1)))
    assert loss.rollout == pytest.approx((1 + 0.92 / 1.1) / 2)
    assert loss.step_s(1.0, 10.0, 5.0) == pytest.approx(1.0 + 10.0 / loss.rollout)


def test_training_restart_by_hand():
    # Three spot training machines at 0.5/h each: Lambda = 1.5/3600 per s; R = 300 s; a checkpoint every 10 steps
    # of 60 s (600 s, shorter than freq_secs 3600): each step takes 60 * (1 + Lambda * (300 + 300)) = 75 s.
    pre = Preemption({"spot": _pool(0.5, 300.0)}, True, LengthDistribution((100,), "test"), 10, 3600)
    loss = pre.loss({"spot": 24}, ())
    assert loss.restarts_per_s == pytest.approx(1.5 / 3600)
    assert loss.step_s(0.0, 50.0, 60.0) == pytest.approx(75.0)
    # freq_secs shorter than the steps' interval: I = 120 s.
    assert Loss(1.0, 1.5 / 3600, 300.0, 10, 120).step_s(0.0, 50.0, 60.0) == pytest.approx(
        60 * (1 + 360 / 3600 * 1.5)
    )
    assert pre.may_train({"spot": 24})
    kept = Preemption(pre.pools, False, pre.lengths)
    assert kept.may_train({"spot": 0, "other": 8}) and not kept.may_train({"spot": 8})


def test_spot_rollout_pool_lowers_expected_tokens_per_s():
    reliable = plan_recipe(load_recipe(RECIPE, FAST))
    # At the reliable plan's price: without a budget the plan rents spot machines until rollout keeps up with
    # training again (the same tokens/s, dearer).
    budget = f"hex.objective.budget_per_hour={reliable.predicted.cost_per_hour}"
    lossy = plan_recipe(load_recipe(RECIPE, [*FAST, budget, *spot(1)]))
    p = lossy.predicted
    assert p.loss_free_tokens_per_s is not None
    assert p.tokens_per_s < p.loss_free_tokens_per_s
    assert p.tokens_per_s < reliable.predicted.tokens_per_s
    assert reliable.predicted.loss_free_tokens_per_s == reliable.predicted.tokens_per_s
    # The uniform ablation is priced as the plan is; the spot pool alone cannot train.
    assert lossy.baselines["uniform"].tokens_per_s <= p.tokens_per_s
    assert "kept off preemptible pools" in lossy.baselines["homogeneous-H20"].note
    text = describe_plan(lossy)
    assert "with none lost" in text and f"{p.tokens_per_s:,.0f} tokens/s" in text
    assert "with none lost" not in describe_plan(reliable)


def test_training_kept_off_preemptible_pools_unless_allowed():
    # The H800 pool, where training goes when reliable, becomes spot: training moves to the H20s.
    kept = plan_recipe(load_recipe(RECIPE, [*FAST, *spot(0, 0.5)]))
    assert {s.pool for s in kept.train.stages} == {"h20"}
    assert kept.predicted.tokens_per_s == kept.predicted.loss_free_tokens_per_s  # nothing preemptible trains
    allowed = [*FAST, *spot(0, 0.5), "hex.solver.train_on_preemptible=true", "recover.mode=auto"]
    plan = plan_recipe(load_recipe(RECIPE, [*allowed, "recover.freq_steps=10"]))
    assert {s.pool for s in plan.train.stages} == {"h800"}
    p = plan.predicted
    # Each training machine adds its restarts: 1 + Lambda (R + I / 2) over the loss-free step.
    machines = math.ceil(plan.train.gpus["H800-PCIe"] / 8)
    free_step = p.step_time_s * p.tokens_per_s / p.loss_free_tokens_per_s
    interval = min(10 * free_step, 3600)  # the recipe's recover.freq_secs is 3600
    factor = 1 + machines * 0.5 / 3600 * (300 + interval / 2)
    assert p.loss_free_tokens_per_s / p.tokens_per_s == pytest.approx(factor, rel=1e-3)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["recover.mode=disabled"], "recover.mode"),
        (["recover.mode=auto", "recover.freq_secs=null"], "recover.freq_steps"),
    ],
)
def test_training_on_spot_needs_recover_checkpoints(overrides, field):
    recipe = load_recipe(RECIPE, [*FAST, *spot(0), "hex.solver.train_on_preemptible=true", *overrides])
    with pytest.raises(HexError) as error:
        plan_recipe(recipe)
    assert error.value.field == field


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            ["+hex.cluster.pools.1.preemptible=true", "+hex.cluster.pools.1.recovery_s=60"],
            "preemptions_per_hour",
        ),
        (
            ["+hex.cluster.pools.1.preemptible=true", "+hex.cluster.pools.1.preemptions_per_hour=1"],
            "recovery_s",
        ),
        (["+hex.cluster.pools.1.recovery_s=60"], "recovery_s"),
        ([*spot(1, per_hour=1e6)], "preemptions_per_hour"),
        (["recover.freq_steps=0"], "recover.freq_steps"),
    ],
)
def test_bad_preemption_fields(overrides, field):
    with pytest.raises(HexError) as error:
        load_recipe(RECIPE, [*FAST, *overrides])
    assert error.value.field.endswith(field)


def test_exhaustive_mode_refuses_preemptible_pools():
    from areal_hex_plugin.planner.recipe_planner import PlanRequest

    recipe = load_recipe(REPO / "recipes" / "ci" / "tiny.yaml", spot(1))
    with pytest.raises(HexError) as error:
        plan_recipe(recipe, PlanRequest(exhaustive=True))
    assert error.value.field == "--exhaustive"
