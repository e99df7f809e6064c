"""The re-plan decision after a refit (planner/refit_replan.py), on the CI recipe's two CPU types."""

from __future__ import annotations

import pytest

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.planner.refit_replan import THRESHOLD, decide, score_plan
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO


@pytest.fixture(scope="module")
def planned():
    recipe = load_recipe(REPO / "recipes" / "ci" / "tiny.yaml", [])
    return recipe, plan_recipe(recipe)


def _slower(recipe, gpu_type: str):
    """``gpu_type`` 30% slower in every factor."""
    eff = recipe.calibration.for_gpu(gpu_type)
    factors = {"hbm_fraction": eff.hbm_fraction * 0.7, "infer_mfu": eff.infer_mfu * 0.7,
               "train_mfu": eff.train_mfu * 0.7, "update_fixed_s": eff.update_fixed_s / 0.7}  # fmt: skip
    return recipe.calibration.with_factors(gpu_type, factors, "refit from run t")


def test_a_plan_scored_under_its_own_model_is_its_prediction(planned):
    recipe, plan = planned
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    score = score_plan(cm, plan, recipe.hex.transport)
    assert score.tokens_per_s == pytest.approx(plan.predicted.tokens_per_s, rel=1e-3)
    assert score.shares == pytest.approx([g.share for g in plan.rollout.replicas], abs=1e-3)


def test_the_believed_model_changes_nothing(planned):
    recipe, plan = planned
    decision = decide(recipe, plan, recipe.calibration)
    assert not decision.suggested
    assert decision.gain == pytest.approx(0.0, abs=1e-6)


def test_a_refit_that_changes_the_answer_suggests_the_new_plan(planned):
    recipe, plan = planned
    decision = decide(recipe, plan, _slower(recipe, "CPU-SMALL"), step=10)
    assert decision.suggested and decision.gain > THRESHOLD
    assert decision.diff and any(d.pool == "small" for d in decision.diff)
    change = decision.plan.changes[-1]
    assert change.kind == "replan" and change.reason.startswith("refit") and change.step == 10
    assert change.tokens_per_s_after == pytest.approx(decision.tokens_per_s, rel=1e-6)
    assert change.tokens_per_s_before == pytest.approx(decision.running_tokens_per_s, rel=1e-6)
    d = decision.to_dict()
    assert (
        d["suggested"] and d["machines"] and sum(d["shares_after"].values()) == pytest.approx(1.0, abs=1e-3)
    )


def test_above_the_gain_nothing_is_suggested(planned):
    recipe, plan = planned
    decision = decide(recipe, plan, _slower(recipe, "CPU-SMALL"), threshold=10.0)
    assert decision.diff and not decision.suggested


def test_the_running_layouts_reshared_under_the_refit(planned):
    recipe, plan = planned
    decision = decide(recipe, plan, _slower(recipe, "CPU-SMALL"))
    reshared = decision.reshared(step=5)
    assert [g.share for g in reshared.rollout.replicas] == pytest.approx(decision.shares, abs=1e-6)
    assert sum(decision.shares) == pytest.approx(1.0)
    assert reshared.changes[-1].kind == "reshare" and reshared.changes[-1].step == 5
    assert [(g.pool, g.tp, g.count) for g in reshared.rollout.replicas] == [
        (g.pool, g.tp, g.count) for g in plan.rollout.replicas
    ]


def test_a_refit_that_only_retunes_the_running_layouts_is_suggested():
    # The 1.5B plan's training type 30% faster than believed: every machine keeps its role and layout, but the
    # rollout side should keep more in flight and update more often to match (the true-factor plan does).
    recipe = load_recipe(REPO / "recipes" / "paper" / "1.5b.yaml", [])
    plan = plan_recipe(recipe)
    eff = recipe.calibration.for_gpu("H800-PCIe")
    faster = recipe.calibration.with_factors(
        "H800-PCIe", {"train_mfu": eff.train_mfu * 1.3}, "refit from run t"
    )
    decision = decide(recipe, plan, faster, step=5)
    assert not decision.diff and decision.gain > THRESHOLD and decision.suggested
    assert any("in-flight cap" in r for r in decision.retuned)
    assert decision.to_dict()["runtime"] == list(decision.retuned)
    assert all(r in decision.plan.changes[-1].reason for r in decision.retuned)


def test_the_live_runs_default_threshold_is_the_replays():
    from areal_hex_plugin.specs.config import CalibrationConfig

    assert CalibrationConfig().replan_threshold == THRESHOLD
