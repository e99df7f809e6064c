"""The online refit (costmodel/refit.py): measurements made by a known "true" model are fitted back, the prior
holds what they cannot show, warm-up and a few wild steps do not move a factor, and the refit profile is read
back like any profile."""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from dataclasses import replace

import pytest

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.costmodel.calibration import RANGES, read_profile
from areal_hex_plugin.costmodel.refit import (
    UNCERTAINTY_Z,
    MeasurementWindow,
    ServerSample,
    StepSample,
    diverged,
    median_standard_error,
    refit,
    server_tokens_per_s,
)
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.planner.refit_replan import plan_layout
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO

RECIPE = REPO / "recipes" / "paper" / "1.5b.yaml"


@pytest.fixture(scope="module")
def run():
    recipe = load_recipe(RECIPE, [])
    plan = plan_recipe(recipe)
    return recipe, plan, plan_layout(plan, recipe.hex.transport)


def _truth(recipe, gpu_type: str, scale: float):
    eff = recipe.calibration.for_gpu(gpu_type)
    factors = {f: getattr(eff, f) * scale for f in ("train_mfu", "hbm_fraction", "update_gb_per_s")}
    return recipe.calibration.with_factors(gpu_type, factors, "truth")


def _step(cm: CostModel, plan, layout, running: int = 48, slow: float = 1.0) -> StepSample:
    """One step as ``cm`` runs it (every figure ``slow`` times slower)."""
    servers = tuple(
        ServerSample(
            g.pool, g.tp, g.pp, running, server_tokens_per_s(cm, (g.pool, g.tp, g.pp), running) / slow
        )
        for g in plan.rollout.replicas
        for _ in range(g.count)
    )
    return StepSample(servers, layout.train_s(cm) * slow, layout.sync_s(cm) * slow)


def _window(cm, plan, layout, steps: int = 10) -> MeasurementWindow:
    window = MeasurementWindow()
    for _ in range(steps):
        window.add(_step(cm, plan, layout))
    return window


def test_the_refit_finds_the_true_factors_the_measurements_show(run):
    recipe, plan, layout = run
    trained = recipe.cluster.pool(plan.train.stages[0].pool).gpu_type
    truth = _truth(recipe, trained, 0.7)
    true_cm = CostModel(recipe.cluster, recipe.workload, truth)
    prior = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    fit = refit(prior, layout, _window(true_cm, plan, layout).measured(), "t1")
    assert fit.calibration.for_gpu(trained).train_mfu == pytest.approx(
        truth.for_gpu(trained).train_mfu, rel=0.02
    )
    # Every measured figure is reproduced, where the prior was 30% off.
    assert fit.rms_log_error < 0.02
    assert max(abs(p["before"] / p["measured"] - 1) for p in fit.points) > 0.2
    assert fit.calibration.source(trained, "train_mfu").startswith("refit from run t1: steps 3-10")


def test_measured_as_believed_nothing_moves(run):
    recipe, plan, layout = run
    prior = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    fit = refit(prior, layout, _window(prior, plan, layout).measured(), "t1")
    # Measured as believed: nothing moves, not even along the fit's flat valley (one running count measured).
    for gpu_type in fit.gpu_types:
        for factor, value in fit.factors[gpu_type].items():
            assert value == pytest.approx(getattr(recipe.calibration.for_gpu(gpu_type), factor), rel=1e-6)


def test_the_median_standard_error_is_the_spread_of_medians_over_many_windows():
    """Over 4,000 windows of 10 steps with 10% lognormal noise the medians scatter by what one window's estimate
    says (within 15%), and a steady window says 0."""
    draws = random.Random(7)
    logs, estimates = [], []
    for _ in range(4000):
        values = [100.0 * math.exp(draws.gauss(0.0, 0.1)) for _ in range(10)]
        logs.append(math.log(statistics.median(values)))
        estimates.append(median_standard_error(values))
    assert statistics.median(estimates) == pytest.approx(statistics.stdev(logs), rel=0.15)
    assert median_standard_error([42.0] * 10) == 0.0
    assert median_standard_error([42.0]) == 0.0


def test_the_window_is_as_uncertain_as_its_least_certain_median(run):
    """Steps as believed: no uncertainty. One figure that scatters (here the train step) sets it: UNCERTAINTY_Z of
    its median's standard errors; the servers' steady figures add nothing."""
    recipe, plan, layout = run
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    assert _window(cm, plan, layout).measured().uncertainty == 0.0
    window = MeasurementWindow(warmup=0)
    slow = [1.0, 1.3, 0.8, 1.1, 0.9, 1.25, 1.0, 0.85]
    for k in slow:
        step = _step(cm, plan, layout)
        window.add(replace(step, train_s=step.train_s * k))
    train = [_step(cm, plan, layout).train_s * k for k in slow]
    measured = window.measured()
    assert measured.uncertainty == pytest.approx(UNCERTAINTY_Z * median_standard_error(train))
    assert 0.05 < measured.uncertainty < 0.3


def test_warm_up_and_a_few_wild_steps_do_not_throw_a_factor(run):
    recipe, plan, layout = run
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    window = MeasurementWindow(warmup=2, steps=10)
    for _ in range(2):  # warm-up: ten times slower, dropped
        window.add(_step(cm, plan, layout, slow=10.0))
    for k in range(10):  # three steps of ten wildly slow: the medians ignore them
        window.add(_step(cm, plan, layout, slow=10.0 if k in (1, 4, 7) else 1.0))
    fit = refit(cm, layout, window.measured(), "t1")
    for gpu_type in fit.gpu_types:
        for factor, value in fit.factors[gpu_type].items():
            assert value == pytest.approx(getattr(recipe.calibration.for_gpu(gpu_type), factor), rel=0.05)


def test_one_window_far_off_moves_factors_inside_their_ranges(run):
    recipe, plan, layout = run
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    window = MeasurementWindow()
    for _ in range(6):
        window.add(_step(cm, plan, layout, slow=20.0))
    fit = refit(cm, layout, window.measured(), "t1")
    for gpu_type in fit.gpu_types:
        for factor, value in fit.factors[gpu_type].items():
            assert value in RANGES[factor]


def test_the_refit_profile_is_a_profile_a_recipe_reads(run, tmp_path):
    recipe, plan, layout = run
    trained = recipe.cluster.pool(plan.train.stages[0].pool).gpu_type
    true_cm = CostModel(recipe.cluster, recipe.workload, _truth(recipe, trained, 0.7))
    prior = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    fit = refit(prior, layout, _window(true_cm, plan, layout).measured(), "t1")
    path = tmp_path / "hex_profile.json"
    path.write_text(json.dumps(fit.profile()))
    assert read_profile(path)[trained]["train_mfu"] == pytest.approx(
        fit.factors[trained]["train_mfu"], rel=1e-3
    )
    again = load_recipe(RECIPE, [f"hex.calibration.profile={path}"])
    assert again.calibration.for_gpu(trained).train_mfu == pytest.approx(
        fit.factors[trained]["train_mfu"], rel=1e-3
    )
    assert again.calibration.source(trained, "train_mfu").startswith("refit from run t1")
    # Its residual spread bounds the plans made with it (issue 33: planner/interval.py).
    assert again.calibration.residual(trained) == pytest.approx(fit.rms_log_error, abs=1e-4)


def test_a_refit_takes_well_under_a_cpu_second(run):
    recipe, plan, layout = run
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    measured = _window(cm, plan, layout).measured()
    started = time.process_time()
    refit(cm, layout, measured, "t1")
    assert time.process_time() - started < 1.0


def test_each_pools_update_tells_which_types_update_cost_is_off():
    # Both CPU types believe a 1.5 s fixed cost per update; CPU-SMALL's is really 2.2 s. The whole update pays
    # the slowest type's fixed cost, so it cannot say which; each receiving pool's own update can.
    recipe = load_recipe(REPO / "recipes" / "ci" / "tiny.yaml", [])
    plan = plan_recipe(recipe)
    layout = plan_layout(plan, recipe.hex.transport)
    truth = recipe.calibration.with_factors("CPU-SMALL", {"update_fixed_s": 2.2}, "truth")
    true_cm = CostModel(recipe.cluster, recipe.workload, truth)
    pools = sorted({stages[0].pool for stages, _ in layout.replicas})
    assert len(pools) == 2
    window = MeasurementWindow()
    for _ in range(6):
        step = _step(true_cm, plan, layout)
        window.add(replace(step, pool_sync_s=tuple((p, layout.sync_s(true_cm, p)) for p in pools)))
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    fit = refit(cm, layout, window.measured(), "t1")
    assert fit.factors["CPU-SMALL"]["update_fixed_s"] == pytest.approx(2.2, rel=0.05)
    assert fit.factors["CPU-BIG"]["update_fixed_s"] == pytest.approx(1.5, rel=0.05)


def test_a_shipped_sourced_figure_never_moves_however_far_the_run_is(run):
    """A GPU type of the shipped catalog decoding 5x faster than its datasheet figures allow: its factors end
    at their range ends, but the figures (sourced, not a recipe's belief) are not refit."""
    recipe, plan, layout = run
    gpu_type = recipe.cluster.pool(plan.rollout.replicas[0].pool).gpu_type
    spec = recipe.catalog.get(gpu_type)
    faster = {f: getattr(spec, f) * 5 for f in ("hbm_tb_per_s", "tflops_bf16")}
    truth = recipe.calibration.with_figures(gpu_type, faster, "truth")
    true_cm = CostModel(recipe.cluster, recipe.workload, truth)
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    fit = refit(cm, layout, _window(true_cm, plan, layout).measured(), "t1")
    assert fit.factors[gpu_type]["hbm_fraction"] == pytest.approx(RANGES["hbm_fraction"].high, rel=0.01)
    assert fit.figures == {} and fit.calibration.figures == ()


@pytest.mark.parametrize("faster", [1.1, 1 / 1.1])
def test_a_declared_figure_that_the_factors_explain_does_not_move(faster):
    """The tiny recipe's own hex.gpu_catalog, its servers 10% off the model: the factors take it inside their
    ranges and the declared figures stay."""
    recipe = load_recipe(REPO / "recipes" / "ci" / "tiny.yaml", [])
    plan = plan_recipe(recipe)
    layout = plan_layout(plan, recipe.hex.transport)
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    window = MeasurementWindow()
    for _ in range(6):
        window.add(_step(cm, plan, layout, running=4, slow=1 / faster))
    fit = refit(cm, layout, window.measured(), "t1")
    assert fit.figures == {} and all(
        RANGES["hbm_fraction"].low < fit.factors[t]["hbm_fraction"] < RANGES["hbm_fraction"].high
        for t in ("CPU-BIG", "CPU-SMALL")
    )


@pytest.mark.parametrize("fixed_s", [0.15, 4.5], ids=["faster", "slower"])
def test_a_whole_update_off_the_belief_moves_every_type_alike(fixed_s: float):
    """Both CPU types believe a 1.5 s fixed cost per update; both really take ``fixed_s``, and the run times the
    whole update only (as the live run does). The whole update pays the slowest type's fixed cost, so it cannot
    tell the types apart: the refit moves both by one multiplier, to what the update takes. (Faster: moving one
    type alone changes nothing. Slower: fitted type by type, the type whose fixed cost the whole update does not
    pay fell back to the prior's 1.5 s, and the planner, believing one pool's update 3x the other's, left the CPU
    e2e's CPU-SMALL idle on no evidence.)"""
    recipe = load_recipe(REPO / "recipes" / "ci" / "tiny.yaml", [])
    plan = plan_recipe(recipe)
    layout = plan_layout(plan, recipe.hex.transport)
    truth = recipe.calibration
    for gpu_type in ("CPU-BIG", "CPU-SMALL"):
        truth = truth.with_factors(gpu_type, {"update_fixed_s": fixed_s}, "truth")
    true_cm = CostModel(recipe.cluster, recipe.workload, truth)
    window = MeasurementWindow()
    for _ in range(6):
        window.add(_step(true_cm, plan, layout))
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    fit = refit(cm, layout, window.measured(), "t1")
    fixed = {t: fit.factors[t]["update_fixed_s"] for t in ("CPU-BIG", "CPU-SMALL")}
    assert fixed["CPU-BIG"] == pytest.approx(fixed["CPU-SMALL"], rel=1e-6), fixed
    (point,) = [p for p in fit.points if p["what"] == "sync_s"]
    assert max(point["before"], point["measured"]) > 2.5 * min(point["before"], point["measured"]), point
    assert point["model"] == pytest.approx(point["measured"], rel=0.1), point


@pytest.mark.parametrize("k", [1 / 6, 10.0])
def test_a_train_step_no_train_mfu_in_range_explains_keeps_the_running_train_factors_alone(run, k):
    """A trainer 6x faster (10x slower) than the model gives at any train_mfu in range: that phase keeps the
    running model's train factors, its point says why and leaves the residual, and the servers, measured as the
    true model runs them 30% off the belief (faster), are refit all the same (diverged says nothing)."""
    recipe, plan, layout = run
    served = {recipe.cluster.pool(g.pool).gpu_type for g in plan.rollout.replicas}
    truth = recipe.calibration
    for gpu_type in served:
        eff = truth.for_gpu(gpu_type)
        truth = truth.with_factors(
            gpu_type, {f: getattr(eff, f) * 1.3 for f in ("hbm_fraction", "infer_mfu")}
        )
    true_cm = CostModel(recipe.cluster, recipe.workload, truth)
    prior = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    window = MeasurementWindow()
    for _ in range(10):
        step = _step(true_cm, plan, layout)
        window.add(replace(step, train_s=layout.train_s(prior) * k))
    fit = refit(prior, layout, window.measured(), "t1")
    assert diverged(fit) is None
    trained = {recipe.cluster.pool(s.pool).gpu_type for s in plan.train.stages}
    for gpu_type in trained:
        assert fit.calibration.for_gpu(gpu_type).train_mfu == recipe.calibration.for_gpu(gpu_type).train_mfu
        assert not fit.calibration.source(gpu_type, "train_mfu").startswith("refit")
    (train,) = [p for p in fit.points if p["what"] == "train_s"]
    assert train["model"] == pytest.approx(layout.train_s(prior)) and "held" in train
    assert "no train_mfu in its range" in train["held"] and f"{train['measured']:.3g} s" in train["held"]
    assert fit.held == [f"train_s: {train['held']}"]
    servers = [p for p in fit.points if p["what"] == "rollout_tokens_per_s"]
    assert servers and all(abs(p["before"] / p["measured"] - 1) > 0.1 for p in servers)
    assert all(abs(p["model"] / p["measured"] - 1) < 0.02 for p in servers)
    assert {t for t in served if fit.calibration.source(t, "hbm_fraction").startswith("refit")} == served
    assert fit.rms_log_error < 0.05  # over what it fitted: the held train step is not in it
