"""Plan vs simulation: a step more than 5% off the plan is reported with the step part that differs most."""

from __future__ import annotations

import dataclasses

import pytest

from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.sim.agreement import plan_gap
from areal_hex_plugin.sim.report import describe_simulation
from areal_hex_plugin.sim.result import PoolUsage, SimResult, StepRecord
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO


@pytest.fixture(scope="module")
def plan():
    """A real plan, its phases then set by hand: train 10 s, rollout 8 s, sync 1 s; its replica group split in
    two groups with shares 0.6 and 0.4."""
    planned = plan_recipe(load_recipe(REPO / "recipes/ci/tiny.yaml", []))
    group = planned.rollout.replicas[0]
    groups = [dataclasses.replace(group, share=0.6), dataclasses.replace(group, tp=2 * group.tp, share=0.4)]
    predicted = dataclasses.replace(
        planned.predicted, train_time_s=10.0, rollout_time_s=8.0, weight_sync_s=1.0, step_time_s=11.0
    )
    rollout = dataclasses.replace(planned.rollout, replicas=groups)
    return dataclasses.replace(planned, predicted=predicted, rollout=rollout)


def _result(plan, *, wait=0.0, train=10.0, sync=1.0, routed=None, idle=0.0) -> SimResult:
    steps = [StepRecord(i * 20.0, wait, train, sync, 1000) for i in range(6)]
    shares = [g.share for g in plan.rollout.replicas]
    routed = routed or [round(1000 * s) for s in shares]
    pool = PoolUsage(
        gpus=2,
        train_s=0,
        rollout_s=10,
        sync_s=0,
        idle_s=idle * 2 * 4,
        rollout_gpus=2,
        rollout_idle_s=idle * 2 * 4,
    )
    return SimResult(
        steps=steps,
        warmup_steps=2,
        pools={"p": pool},
        staleness={0: 10},
        interrupted=0,
        routed={f"lane{i}": n for i, n in enumerate(routed)},
        recompute_s_per_update=0.3,
        events=100,
    )


def test_within_five_percent_says_nothing(plan):
    assert plan_gap(_result(plan, wait=0.5), plan) is None
    assert "warning" not in describe_simulation(_result(plan, wait=0.5), plan)


def test_a_slower_trainer_is_named(plan):
    gap = plan_gap(_result(plan, train=12.0), plan)
    assert gap.relative == pytest.approx(2 / 11)
    assert gap.reason == "training takes 12.0 s per step against 10.0 s planned"


def test_a_longer_weight_sync_is_named(plan):
    gap = plan_gap(_result(plan, sync=2.5), plan)
    assert gap.reason == "weight sync takes 2.5 s per step against 1.0 s planned"


def test_waiting_for_rollout_names_a_group_off_its_share(plan):
    first, second = (g.share for g in plan.rollout.replicas)
    # The first group served 20 points more of the samples than planned.
    routed = [round(1000 * (first + 0.2)), round(1000 * (second - 0.2))]
    gap = plan_gap(_result(plan, wait=3.0, routed=routed), plan)
    assert gap.relative == pytest.approx(3 / 11)
    group = plan.rollout.replicas[0]
    assert gap.reason.startswith("the trainer waits 3.0 s per step for its batch against 0.0 s planned; ")
    assert f"replica group {group.pool} tp{group.tp} pp{group.pp} served {first + 0.2:.0%}" in gap.reason


def test_waiting_with_idle_generators_blames_the_bound_not_decoding(plan):
    gap = plan_gap(_result(plan, wait=3.0, idle=2.0), plan)
    assert "generating GPUs idle 2.0 s per step" in gap.reason
    slow = plan_gap(_result(plan, wait=3.0), plan)
    assert "decode the batch slower in the simulation" in slow.reason
    assert describe_simulation(_result(plan, wait=3.0), plan).endswith(slow.warning())


def test_a_faster_simulation_is_reported_too(plan):
    gap = plan_gap(_result(plan, train=8.0), plan)
    assert gap.relative == pytest.approx(-2 / 11)
    assert gap.warning().startswith(
        "warning: the simulated step is -18.2% off the planned one: training takes 8.0"
    )


def test_a_shorter_wait_names_the_longest_sample_the_plan_waits_for(plan):
    """The simulation waits less than planned: upstream's loop overlapped more of the rollouts the plan waits for
    (those admission could not replace during training, or a draining window's)."""
    faster = dataclasses.replace(
        plan, predicted=dataclasses.replace(plan.predicted, rollout_time_s=14.0, step_time_s=15.0)
    )
    gap = plan_gap(_result(faster, wait=0.0), faster)
    assert gap.relative == pytest.approx(11 / 15 - 1)
    assert gap.reason.startswith("the trainer waits 0.0 s per step for its batch against 4.0 s planned; ")
    assert gap.reason.endswith("the plan waits for the rollouts admission could not replace (the longest "
                               "ones), which the simulation overlaps more with the next steps")  # fmt: skip
