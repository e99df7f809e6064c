"""Issue 26, item 2: the knee, not only the maximum. Beside the chosen plan, the cheapest plan within 2% of its
tokens/s and the knee of the frontier; an objective that picks the knee (or the cheapest within a tolerance); the
chosen point always on the printed frontier."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.planner.recipe_planner import KNEE, WITHIN, PlanRequest, knee, plan_recipe
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO

pytestmark = pytest.mark.slow

QUICK = "++hex.solver.time_limit_s=3"
# The review's setting: the plan that spends the budget (the default, since issue 33, is the cheapest within the
# fit's tie band, tests/planner/test_budget_ceiling.py).
FASTEST = "hex.objective.pick=fastest"
SHIPPED = sorted(
    str(p.relative_to(REPO)) for p in (REPO / "recipes").glob("*/*.yaml") if p.parent.name != "ci"
)


def _plan(recipe: str, *overrides: str, pareto: bool = False):
    return plan_recipe(
        load_recipe(REPO / recipe, [QUICK, *overrides], base_dir=REPO), PlanRequest(pareto=pareto)
    )


def _on(point, points) -> bool:
    return any(
        p.cost_per_hour == pytest.approx(point.cost_per_hour, rel=1e-9)
        and p.tokens_per_s == pytest.approx(point.tokens_per_s, rel=1e-9)
        for p in points
    )


def test_the_7b_paper_plan_names_the_knee_and_the_cheapest_plan_within_2_percent():
    """The review: $116.24/h for 11,822 tokens/s chosen while the frontier has $86.64/h for 11,328. With the
    one-runtime profile (issue 33) the chosen plan is itself the cheapest within 2%: never dearer than it."""
    plan = _plan("recipes/paper/7b.yaml", FASTEST, pareto=True)
    chosen = plan.predicted
    within, knee = plan.alternatives[WITHIN], plan.alternatives[KNEE]
    assert within.tokens_per_s >= 0.98 * chosen.tokens_per_s and within.cost_per_hour <= chosen.cost_per_hour
    assert knee.cost_per_hour <= chosen.cost_per_hour and knee.tokens_per_s > 0.95 * chosen.tokens_per_s
    assert _on(within, plan.pareto) and _on(knee, plan.pareto)
    # No frontier point within the budget is cheaper than the 2% plan and within 2% of the chosen one.
    assert not any(
        p.cost_per_hour < within.cost_per_hour and p.tokens_per_s >= 0.98 * chosen.tokens_per_s
        for p in plan.pareto
    )


@pytest.mark.parametrize("recipe", SHIPPED)
def test_the_chosen_plan_is_on_the_printed_frontier(recipe):
    plan = _plan(recipe, pareto=True)
    assert _on(plan.predicted, plan.pareto)
    # ...and nothing on it is as fast for less: within the tie the search settles by cost, and no slower than a
    # single-type baseline the plan prints (the plan never loses to one: 14B's H800 baseline is 0.013% faster
    # than the $114.08/h point on its frontier, so that baseline is the plan).
    singles = [b.tokens_per_s for name, b in plan.baselines.items() if name.startswith("homogeneous-")]
    floor = max([(1 - 1e-3) * plan.predicted.tokens_per_s, *singles])
    assert not any(
        p.cost_per_hour < plan.predicted.cost_per_hour - 1e-6 and p.tokens_per_s >= floor for p in plan.pareto
    )
    assert KNEE in plan.alternatives and WITHIN in plan.alternatives
    # The budget is a ceiling (issue 33, tests/planner/test_budget_ceiling.py): no point of the printed frontier
    # within 2% of the plan's tokens/s costs 5% less.
    assert not any(
        p.tokens_per_s >= 0.98 * plan.predicted.tokens_per_s
        and plan.predicted.cost_per_hour > 1.05 * p.cost_per_hour
        for p in plan.pareto
    )


def test_the_knee_objective_picks_the_knee_and_the_tolerance_the_cheapest_within_it():
    default = _plan("recipes/paper/7b.yaml", FASTEST)
    knee = _plan("recipes/paper/7b.yaml", "+hex.objective.pick=knee")
    assert knee.predicted.cost_per_hour == pytest.approx(knee.alternatives[KNEE].cost_per_hour)
    assert knee.predicted.tokens_per_s == pytest.approx(knee.alternatives[KNEE].tokens_per_s)
    assert (
        knee.predicted.cost_per_hour <= default.predicted.cost_per_hour
    )  # the 7B plan is the knee itself now
    assert _on(knee.predicted, knee.pareto)
    tolerant = _plan("recipes/paper/7b.yaml", FASTEST, "+hex.objective.throughput_tolerance=0.02")
    assert tolerant.predicted.cost_per_hour == pytest.approx(default.alternatives[WITHIN].cost_per_hour)
    assert tolerant.predicted.tokens_per_s >= 0.98 * default.predicted.tokens_per_s


def test_the_knee_needs_a_budget_or_the_whole_inventory(capsys):
    code = main(
        ["plan", "recipes/paper/7b.yaml", QUICK, "+hex.objective.pick=knee", "--target-tokens-per-s", "5000"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: hex.objective.pick") and "Traceback" not in err


def test_plan_prints_cost_and_hours_per_n_steps(capsys):
    assert main(["plan", "recipes/paper/7b.yaml", QUICK, "--steps", "200", "--json", "-"]) == 0
    out = capsys.readouterr()
    assert "$ per 200 steps" in out.err and "hours per 200 steps" in out.err and "$ per 1M tokens" in out.err
    for label in ("chosen", "cheapest within 2%", "knee of the frontier"):
        assert label in out.err
    import json

    plan = json.loads(out.out)
    p = plan["predicted"]
    hours = 200 * p["step_time_s"] / 3600
    row = next(line for line in out.err.splitlines() if line.startswith("chosen"))
    assert f"{hours:,.2f}" in row and f"{hours * p['cost_per_hour']:,.2f}" in row
    per_million = p["cost_per_hour"] / (p["tokens_per_s"] * 3600) * 1e6
    assert f"{per_million:,.2f}" in row


def test_the_knee_is_the_fastest_plan_near_the_lowest_cost_per_token():
    def point(cost, rate):
        return SimpleNamespace(cost_per_hour=cost, rate=rate)

    def rate(p):
        return p.rate

    # The 7B paper frontier within its budget: $86.64/h is the cheapest per token; past it tokens cost more.
    paper = [
        point(29.6, 1102),
        point(57.04, 4293),
        point(86.64, 11328),
        point(101.44, 11800),
        point(116.24, 11822),
    ]
    assert knee(paper, rate).cost_per_hour == 86.64
    # A straight frontier (every plan at one $ per token): its fastest, not an end-point artefact.
    straight = [point(11.12, 9487), point(21.52, 25161), point(32.64, 38234)]
    assert knee(straight, rate).cost_per_hour == 32.64
