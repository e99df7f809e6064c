"""Plots an engineer pastes into a design doc, and the simulated run as a Chrome/Perfetto trace."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import matplotlib.image
import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.plan import ParetoPoint
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.planner.report import _gpus, frontier_figure
from areal_hex_plugin.sim.engine import simulate
from areal_hex_plugin.sim.inputs import sim_spec
from areal_hex_plugin.sim.plot import COLORS, WINDOW_STEPS, _window, pool_order, timelines_figure
from areal_hex_plugin.sim.result import row_order
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO
from tests.planner.helpers import recipe_with_pools

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
    for name, b in plan.baselines.items():  # each baseline's GPU mix
        assert any(label.startswith(f"{name}: {_gpus(b.gpus)}") for label in labels)


def test_baselines_equal_to_the_chosen_plan_are_rings_around_its_star_and_say_so():
    # One GPU type (1.5B on 24 H800-PCIe): the homogeneous and the uniform baselines are the chosen plan itself.
    plan = plan_recipe(recipe_with_pools([("H800-PCIe", 8, 3)], "1.5b"))
    chosen = (plan.predicted.cost_per_hour, plan.predicted.tokens_per_s)
    same = [
        n for n, b in plan.baselines.items() if (b.cost_per_hour, b.tokens_per_s) == pytest.approx(chosen)
    ]
    assert same == ["homogeneous-H800-PCIe", "uniform"]
    ax = frontier_figure(plan).axes[0]
    at_chosen = [c for c in ax.collections if tuple(c.get_offsets()[0]) == pytest.approx(chosen)]
    assert [c.get_label().split(":")[0] for c in at_chosen] == ["chosen", *same]  # the star, then the rings
    # Each marker drawn over the point is wider than those under it (sizes are pt^2: compare widths, in points),
    # and hollow, so the star and every ring stay visible.
    widths = [math.sqrt(c.get_sizes()[0]) for c in at_chosen]
    assert all(outer - inner >= 5 for inner, outer in itertools.pairwise(widths)), widths
    assert all(len(c.get_facecolors()) == 0 for c in at_chosen[1:])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    for name in same:
        assert f"{name}: {_gpus(plan.baselines[name].gpus)} (= chosen)" in labels
    others = set(plan.baselines) - set(same)
    assert others and not any(
        label.endswith("(= chosen)") for label in labels if label.split(":")[0] in others
    )


def _drawn_states(result, window: tuple[float, float]) -> set[str]:
    """The states of every segment that overlaps the window, read from the simulation itself."""
    start, end = window
    return {
        s.state
        for rows in result.timeline.values()
        for segments in rows.values()
        for s in segments
        if s.end_s > start and s.start_s < end
    }


def test_one_figure_has_every_pools_timeline_step_boundaries_and_only_the_states_drawn(run):
    plan, result = run
    start, end, what = _window(result, WINDOW_STEPS)
    assert what == f"steps {8 - WINDOW_STEPS + 1}-8 of 8"
    fig = timelines_figure(result, "Qwen3-4B")
    # One axes per pool, the trainer's on top, each with every replica (and the trainer) of that pool as a row.
    pools = pool_order(result.timeline)
    assert "trainer" in result.timeline[pools[0]] and sorted(pools) == sorted(result.timeline)
    assert [ax.get_title(loc="left") for ax in fig.axes] == [f"pool {pool}" for pool in pools]
    for ax, pool in zip(fig.axes, pools, strict=True):
        rows = result.timeline[pool]
        assert [t.get_text() for t in ax.get_yticklabels()] == sorted(rows, key=row_order)
        assert ax.get_xlim() == (start, end)
    replicas = sum(g.count for g in plan.rollout.replicas)
    assert sum(len([n for n in rows if n != "trainer"]) for rows in result.timeline.values()) == replicas
    # A dashed line at each boundary between the steps drawn, on every pool's axes, each step named above.
    boundaries = [s.end_s for s in result.steps[-WINDOW_STEPS:-1]]
    for ax in fig.axes:
        assert sorted(line.get_xdata()[0] for line in ax.get_lines()) == pytest.approx(boundaries)
    assert [t for t in _texts(fig) if t.startswith("step ")] == [f"step {k}" for k in range(6, 9)]
    # The legend names the states that occur in the window, no other.
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(fig.legends) == 1 and sorted(labels) == sorted(_drawn_states(result, (start, end)))
    assert set(labels) < set(COLORS)  # not the list of every state: this run has no stall
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title, legend = fig._suptitle.get_window_extent(renderer), fig.legends[0].get_window_extent(renderer)
    assert not title.overlaps(legend)
    assert not legend.overlaps(fig.axes[-1].xaxis.label.get_window_extent(renderer))


def test_simulate_plot_writes_one_png(tmp_path, capsys):
    out = tmp_path / "t.png"
    assert main(["simulate", str(MIX), "--steps", "4", "--plot", str(out)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["t.png"]
    image = matplotlib.image.imread(out)  # a PNG that reads back, as tall as two pools' rows need
    assert image.shape[0] > image.shape[1] / 4
    assert f"timeline plotted to {out}" in capsys.readouterr().out


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
