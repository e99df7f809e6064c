"""Issue 14: the two-phase search within 1% of the brute force where it lost to it (eta = 2)."""

from __future__ import annotations

import pytest

from areal_hex_plugin.planner.brute import BruteForce
from areal_hex_plugin.planner.caps import PAPER
from areal_hex_plugin.planner.recipe_planner import Planner, PlanRequest
from tests.planner.helpers import BRUTE_DEPTH, recipe_with_pools


@pytest.mark.parametrize(
    "pools",
    [
        # Same fleet in both; the search split the window's samples in proportion to speed (16,599 vs 16,894).
        [("H20", 2, 1), ("L40S", 4, 2)],
        # 32,925 vs 34,208 tokens/s: proportional shares, and H20 tp2 pp2 x2 at window 1 where the brute force
        # takes tp2 pp4 x1 at window 2 (the search ranks a pool's candidate fleets at full batch and window 1).
        # Once draining windows were priced, the search missed the brute force's fleet (27,900 vs 28,196); since
        # window 1 overlaps its longest samples at eta 2 (costmodel.model.overlaps), it reaches it again.
        # With the H20 factors refitted in the one runtime (issue 33: infer_mfu 0.275, decode overhead 5 ms) the
        # search missed the brute force again (30,799 vs 34,349 tokens/s): the brute force's fleet combines the
        # L40S pool's fleet of the in-flight price program with the H20 pool's of the rebuild-bound program
        # (test_a_pools_price_fleet_combines_with_anothers_bound_fleet).
        [("L40S", 8, 2), ("H20", 4, 2)],
    ],
)
def test_two_phase_is_within_one_percent_of_the_brute_force_at_eta_2(pools):
    recipe = recipe_with_pools(pools, "1.5b", "rollout.max_head_offpolicyness=2", BRUTE_DEPTH)
    planner = Planner(recipe, PlanRequest(caps=PAPER))
    result = planner.search(planner.limits, None)
    brute, _ = BruteForce(planner.ev).run(planner.limits, None)
    assert planner.tokens_per_s(result.best) >= 0.99 * planner.tokens_per_s(brute)


@pytest.mark.parametrize(
    "pools, model",
    [
        # The search's split is the brute force's, but its candidate fleets are each pool's best at full batch:
        # under eta = 1's in-flight budget the best fleet is another mix of replica shapes (58,182 vs 59,362).
        ([("H100", 8, 3), ("L40S", 4, 2)], "7b"),
        # 12,688 vs 13,124 tokens/s, the same cause.
        ([("A800", 8, 3), ("H800-PCIe", 4, 2)], "14b"),
    ],
)
def test_two_phase_is_within_one_percent_of_the_brute_force_at_eta_1(pools, model):
    recipe = recipe_with_pools(pools, model, "rollout.max_head_offpolicyness=1", BRUTE_DEPTH)
    planner = Planner(recipe, PlanRequest(caps=PAPER))
    result = planner.search(planner.limits, None)
    brute, _ = BruteForce(planner.ev).run(planner.limits, None)
    assert planner.tokens_per_s(result.best) >= 0.99 * planner.tokens_per_s(brute)


def test_a_pools_price_fleet_combines_with_anothers_bound_fleet():
    """The brute force's fleet above (L40S tp2 x4 + H20 tp2 pp4 x1) is a candidate of its rollout machines: L40S
    tp2 x4 comes only from the in-flight price program, H20 tp2 pp4 x1 only from the rebuild-bound one."""
    recipe = recipe_with_pools(
        [("L40S", 8, 2), ("H20", 4, 2)], "1.5b", "rollout.max_head_offpolicyness=2", BRUTE_DEPTH
    )
    ev = Planner(recipe, PlanRequest(caps=PAPER)).ev
    shapes = [{(c.pool, c.tp, c.pp, y) for c, y in f.groups} for f in ev.fleets((1, 2))]
    assert {("p0", 2, 1, 4), ("p1", 2, 4, 1)} in shapes
