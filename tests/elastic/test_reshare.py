"""Shares for the servers a run has now, by the planner's rollout model (``planner/reshare.py``)."""

from __future__ import annotations

import math
import random

import pytest

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.planner.reshare import (
    RESOLUTION,
    ServerShape,
    drift,
    replica_config,
    reshare,
    split_makespan_s,
    with_lengths,
)
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO
from tests.elastic.plans import elastic_recipe

SERVERS = [ServerShape("big", 1), ServerShape("small", 2), ServerShape("big", 1)]


@pytest.fixture(scope="module")
def recipe():
    return elastic_recipe()


def _cm(recipe, workload=None) -> CostModel:
    return CostModel(recipe.cluster, workload or recipe.workload, recipe.calibration)


def _brute_makespan(big, small, x_big: int, mean: float) -> float:
    """The step of ``x_big`` of the RESOLUTION samples on the two big servers (the busier one takes the odd one)
    and the rest on the small one: each server's samples at its speed, plus one KV rebuild (at eta 1 a step does
    not wait for its longest sample)."""
    x_small = RESOLUTION - x_big
    return max(
        math.ceil(x_big / 2) * mean / big.tokens_per_s + big.recompute_s,
        x_small * mean / small.tokens_per_s + small.recompute_s,
    )


def test_the_shares_are_the_least_makespan_of_every_split_over_the_live_servers(recipe):
    """Against the brute force: every split of the samples between the big pair and the small server."""
    assert recipe.workload.rl.max_head_offpolicyness == 1
    cm = _cm(recipe)
    big, small, mean = (
        replica_config(cm, SERVERS[0]),
        replica_config(cm, SERVERS[1]),
        cm.workload.output_lengths.mean,
    )
    best = min(_brute_makespan(big, small, x, mean) for x in range(1, RESOLUTION))
    result = reshare(cm, SERVERS, [True, True, True])
    assert sum(result.shares) == pytest.approx(1.0) and result.shares[0] == result.shares[2]
    assert result.makespan_s == pytest.approx(best)
    x_big = round((result.shares[0] + result.shares[2]) * RESOLUTION)
    assert _brute_makespan(big, small, x_big, mean) == pytest.approx(best)


@pytest.mark.parametrize("x_big", [2, 400, 700, 998])
def test_a_split_held_is_scored_as_the_brute_force_scores_it(recipe, x_big: int):
    """Any split (not only the best one) as the brute force scores it: what a re-share would gain over the
    shares a run holds."""
    cm = _cm(recipe)
    big, small = replica_config(cm, SERVERS[0]), replica_config(cm, SERVERS[1])
    shares = [x_big / 2 / RESOLUTION, (RESOLUTION - x_big) / RESOLUTION, x_big / 2 / RESOLUTION]
    held = split_makespan_s(cm, SERVERS, [True, True, True], shares)
    assert held == pytest.approx(_brute_makespan(big, small, x_big, cm.workload.output_lengths.mean))
    assert held >= reshare(cm, SERVERS, [True, True, True]).makespan_s


def test_a_dead_server_gets_nothing_and_the_rest_take_its_share(recipe):
    cm = _cm(recipe)
    full, lost = reshare(cm, SERVERS, [True, True, True]), reshare(cm, SERVERS, [True, False, True])
    assert lost.shares[1] == 0.0 and lost.shares[0] == lost.shares[2] == pytest.approx(0.5)
    assert lost.makespan_s > full.makespan_s  # fewer servers, a longer step
    with pytest.raises(ValueError, match="no live"):
        reshare(cm, SERVERS, [False, False, False])


def test_longer_outputs_move_the_shares(recipe):
    """At the tiny recipe's scale the slower pool gains relatively more from longer outputs (its fixed costs
    are amortised over more tokens): doubled lengths move the shares by the model's own numbers."""
    short = with_lengths(recipe.workload, [4] * 64, "measured")
    long = with_lengths(recipe.workload, [8] * 64, "measured")
    a = reshare(_cm(recipe, short), SERVERS[:2], [True, True])
    b = reshare(_cm(recipe, long), SERVERS[:2], [True, True])
    assert b.makespan_s > 1.5 * a.makespan_s
    assert b.shares[1] > a.shares[1]


def test_served_lengths_scale_the_plans_to_their_mean_capped_like_them(recipe):
    cap = recipe.workload.rl.max_new_tokens
    workload = with_lengths(recipe.workload, [1000, 0, 5], "measured")
    lengths = workload.output_lengths
    assert lengths.mean == pytest.approx((cap + 1 + 5) / 3, rel=0.05) and lengths.max <= cap
    assert (
        len(lengths.lengths) == len(recipe.workload.output_lengths.lengths) and lengths.source == "measured"
    )
    # A basis scaled to a mean stays put when served that mean again.
    assert with_lengths(workload, [cap, 1, 5], "again").output_lengths.lengths == lengths.lengths


def test_a_step_of_the_plans_own_lengths_is_no_drift():
    """Found (issue 23): the drift check rebuilt the cost model from one step's served lengths, tail and all. With
    the paper's lengths (a point mass at the 27,648-token cap, about 5 samples per 1,000) a step's few samples at
    the cap set the in-flight context and the caps: on 7b4ce83 this test's draws read up to +89% (-27% to +22% in
    the fault simulator), past the 20% threshold, and shares re-balanced on noise. Doubled lengths still read as
    drift."""
    paper = load_recipe(REPO / "recipes/paper/7b.yaml", [])
    cm = CostModel(paper.cluster, paper.workload, paper.calibration)
    servers, live = [ServerShape("h20", 1)] * 4 + [ServerShape("h800", 1)] * 4, [True] * 8
    dist, rng = paper.workload.output_lengths, random.Random(0)
    changes = [drift(cm, servers, live, dist.sample(rng, 500), "step").change for _ in range(20)]
    assert max(abs(c) for c in changes) < 0.2
    doubled = [2 * n for n in dist.sample(rng, 500)]
    assert drift(cm, servers, live, doubled, "doubled").change > 0.2
