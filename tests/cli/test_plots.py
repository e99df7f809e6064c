"""Plots an engineer pastes into a design doc, and the simulated run as a Chrome/Perfetto trace."""

from __future__ import annotations

import dataclasses
import json

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.plan import ParetoPoint
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.planner.report import _gpus, frontier_figure
from areal_hex_plugin.sim.engine import simulate
from areal_hex_plugin.sim.inputs import sim_spec
from areal_hex_plugin.sim.plot import WINDOW_STEPS, _window, timeline_figure
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO

MIX = REPO / "recipes/mixes/h100_rtx4090_qwen3-4b.yaml"
PAPER_7B = REPO / "recipes/paper/7b.yaml"


@pytest.fixture(scope="module")
def run():
    recipe = load_recipe(MIX)
    plan = plan_recipe(recipe)
    return plan, simulate(sim_spec(recipe, plan), steps=8, seed=0, timeline=True)


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_the_pareto_plot_has_units_the_budget_line_and_each_points_gpu_mix():
    plan = plan_recipe(load_recipe(PAPER_7B))
    p = plan.predicted
    points = [ParetoPoint(p.cost_per_hour / 2, p.tokens_per_s / 3, {"H20": 8}), ParetoPoint(p.cost_per_hour, p.tokens_per_s, {"H20": 16, "H800-PCIe": 16})]  # fmt: skip
    fig = frontier_figure(dataclasses.replace(plan, pareto=points))
    ax = fig.axes[0]
    assert "$" in ax.get_xlabel() and "hour" in ax.get_xlabel() and "tokens/s" in ax.get_ylabel()
    assert {"8 H20", "16 H20 + 16 H800-PCIe"} <= set(_texts(fig))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert f"budget ${plan.objective.budget_per_hour:,.2f}/h" in labels
    budget = next(line for line in ax.get_lines() if line.get_label().startswith("budget"))
    assert list(budget.get_xdata()) == [plan.objective.budget_per_hour] * 2
    for name, b in plan.baselines.items():
        assert f"{name}: {_gpus(b.gpus)}" in labels  # each baseline's GPU mix


def test_the_timeline_draws_every_replica_over_the_last_steps_with_the_title_clear_of_the_legend(run):
    plan, result = run
    pool = next(g.pool for g in plan.rollout.replicas)
    rows = result.timeline[pool]
    replicas = sum(g.count for g in plan.rollout.replicas if g.pool == pool)
    assert len([n for n in rows if n != "trainer"]) == replicas
    start, end, what = _window(result, WINDOW_STEPS)
    fig = timeline_figure(rows, f"pool {pool}, {what}", (start, end))
    ax = fig.axes[0]
    assert len(ax.get_yticks()) == len(rows) and ax.get_xlim() == (start, end)
    assert what == f"steps {8 - WINDOW_STEPS + 1}-8 of 8"
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title, legend = ax.title.get_window_extent(renderer), fig.legends[0].get_window_extent(renderer)
    assert not title.overlaps(legend)
    assert not legend.overlaps(ax.xaxis.label.get_window_extent(renderer))


def test_simulate_trace_has_every_replica_and_every_step(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["simulate", str(MIX), "--steps", "4", "--trace", str(out)]) == 0
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    plan = plan_recipe(load_recipe(MIX))
    assert len(threads - {"trainer"}) == sum(g.count for g in plan.rollout.replicas)
    steps = [e for e in events if e["ph"] == "X" and e["pid"] == 0]
    assert [e["name"] for e in steps] == ["step 1", "step 2", "step 3", "step 4"]
    work = [e for e in events if e["ph"] == "X" and e["pid"] > 0]
    assert {e["name"] for e in work} >= {"train", "decode", "sync"} and all(e["dur"] > 0 for e in work)
    assert "trace written to" in capsys.readouterr().out
