"""The CP-SAT models against brute force: rollout replica program, Eq. (3) repartition, EM balance model."""

from __future__ import annotations

from itertools import combinations, product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.planner.balance_model import BalanceRequest, solve_balance
from areal_hex_plugin.planner.cpsat import clock
from areal_hex_plugin.planner.evaluate import Evaluator, prune_dominated
from areal_hex_plugin.planner.inflight import window_rollout_s
from areal_hex_plugin.planner.partition_model import PartitionRequest, solve_partition
from areal_hex_plugin.planner.rollout_model import ReplicaConfig, largest_remainder, solve_rollout
from areal_hex_plugin.planner.search import _balance, _first_stride
from areal_hex_plugin.planner.split import Split, all_splits, count_splits
from areal_hex_plugin.planner.train_search import tp_degrees
from tests.planner.helpers import recipe_with_pools


def brute_knapsack(configs: list[ReplicaConfig], gpus: int) -> float:
    ranges = [range(gpus // c.gpus + 1) for c in configs]
    return max(
        sum(c.tokens_per_s * y for c, y in zip(configs, ys, strict=True))
        for ys in product(*ranges)
        if sum(c.gpus * y for c, y in zip(configs, ys, strict=True)) <= gpus
    )


@settings(max_examples=25, deadline=None)
@given(
    speeds=st.lists(st.floats(min_value=10, max_value=5000), min_size=4, max_size=4),
    gpus=st.integers(min_value=1, max_value=24),
)
def test_rollout_program_matches_brute_force(speeds, gpus):
    shapes = [(1, 1), (2, 1), (4, 1), (2, 2)]
    configs = [ReplicaConfig("p", tp, pp, h, 8) for (tp, pp), h in zip(shapes, speeds, strict=True)]
    solution = solve_rollout(configs, gpus)
    assert solution.optimal
    assert sum(c.gpus * y for c, y in solution.counts) <= gpus
    assert solution.tokens_per_s == pytest.approx(brute_knapsack(configs, gpus), rel=1e-5)


def full_knapsack(configs: list[ReplicaConfig], gpus: int) -> float:
    """Unbounded knapsack over every capacity up to ``gpus`` (the textbook table, no shortcut)."""
    best = [0.0] * (gpus + 1)
    for c in range(1, gpus + 1):
        best[c] = max([best[c - 1]] + [best[c - x.gpus] + x.tokens_per_s for x in configs if x.gpus <= c])
    return best[gpus]


@settings(max_examples=15, deadline=None)
@given(
    speeds=st.lists(st.floats(min_value=10, max_value=5000), min_size=7, max_size=7),
    gpus=st.integers(min_value=1, max_value=12_000),
)
def test_rollout_program_is_exact_at_thousands_of_replicas(speeds, gpus):
    shapes = [(1, 1), (2, 1), (4, 1), (8, 1), (2, 3), (8, 4), (4, 3)]
    configs = [ReplicaConfig("p", tp, pp, h, 8) for (tp, pp), h in zip(shapes, speeds, strict=True)]
    solution = solve_rollout(configs, gpus)
    assert sum(c.gpus * y for c, y in solution.counts) <= gpus
    assert solution.tokens_per_s == pytest.approx(full_knapsack(configs, gpus), rel=1e-9)
    assert solution.tokens_per_s == pytest.approx(sum(c.tokens_per_s * y for c, y in solution.counts))


@given(
    total=st.integers(min_value=0, max_value=5000),
    weights=st.lists(st.floats(0.01, 100), min_size=1, max_size=8),
)
def test_largest_remainder_sums_and_stays_within_one(total, weights):
    parts = largest_remainder(total, weights)
    assert sum(parts) == total
    for part, w in zip(parts, weights, strict=True):
        assert abs(part - total * w / sum(weights)) < 1


def test_dominated_replica_shapes_are_dropped():
    small = ReplicaConfig("p", 1, 1, 100.0, 8)
    two_slow = ReplicaConfig("p", 2, 1, 150.0, 8)  # two copies of `small` give 200
    four_fast = ReplicaConfig("p", 4, 1, 450.0, 8)  # beats four copies of `small`
    four_pp = ReplicaConfig("p", 2, 2, 400.0, 8)  # same GPU count as four_fast, slower
    assert prune_dominated([four_pp, two_slow, small, four_fast]) == [small, four_fast]


def test_tp_degrees_form_a_divisibility_chain():
    assert tp_degrees(8) == [1, 2, 4, 8]
    assert tp_degrees(6) == [1, 2, 6]
    assert tp_degrees(1) == [1]
    for g in range(1, 17):
        chain = tp_degrees(g)
        assert all(b % a == 0 for a, b in zip(chain, chain[1:], strict=False)) and g % chain[-1] == 0


def eq3_by_gpu_pairs(cluster, split: Split, limits) -> float:
    """Eq. (3) evaluated literally, GPU by GPU, over the GPUs within ``limits``."""
    gpus = []  # (pool, machine, role)
    for pool, t, r, m in zip(cluster.pools, split.train, split.rollout, limits, strict=True):
        for machine in range(m):
            role = "T" if machine < t else "I" if machine < t + r else "-"
            gpus += [(pool, machine, role)] * pool.gpus_per_machine

    def beta(a, b):
        if a[0] is b[0] and a[1] == b[1]:
            return a[0].intra_machine_gb_per_s
        return cluster.link_gb_per_s(a[0].name, b[0].name)

    pairs = list(combinations(gpus, 2))
    link = sum(beta(a, b) for a, b in pairs if a[2] == b[2] == "T") / sum(beta(a, b) for a, b in pairs)
    hbm = sum(g[0].gpu.hbm_tb_per_s for g in gpus if g[2] == "I") / sum(g[0].gpu.hbm_tb_per_s for g in gpus)
    return link + hbm


def compute_share(cluster, split: Split) -> float:
    used = sum(
        (t + r) * p.gpus_per_machine * p.gpu.tflops_bf16
        for p, t, r in zip(cluster.pools, split.train, split.rollout, strict=True)
    )
    return (
        sum(
            t * p.gpus_per_machine * p.gpu.tflops_bf16
            for p, t in zip(cluster.pools, split.train, strict=True)
        )
        / used
    )


@pytest.mark.parametrize(("lo", "hi", "budget"), [(0.2, 0.6, None), (0.5, 0.9, None), (0.1, 0.5, 60.0)])
def test_partition_model_is_the_argmax_of_eq3(lo, hi, budget):
    cluster = recipe_with_pools([("H800-PCIe", 4, 3), ("H20", 2, 3), ("L40S", 4, 2)]).cluster
    limits = (3, 3, 2)
    split = solve_partition(cluster, PartitionRequest(limits, lo, hi, budget), 10.0, 1, 0)
    candidates = [
        s
        for s in all_splits(limits)
        if lo - 1e-3 <= compute_share(cluster, s) <= hi + 1e-3
        and (budget is None and all(t + r == m for t, r, m in zip(s.train, s.rollout, limits, strict=True))
             or budget is not None and s.cost_per_hour(cluster) <= budget)
    ]  # fmt: skip
    assert split in candidates
    best = max(eq3_by_gpu_pairs(cluster, s, limits) for s in candidates)
    # Objective coefficients are rounded to 1e-6 of each term.
    assert eq3_by_gpu_pairs(cluster, split, limits) == pytest.approx(best, abs=1e-4)


def test_partition_model_reports_an_empty_band():
    cluster = recipe_with_pools([("H800-PCIe", 8, 1), ("H20", 8, 1)]).cluster
    # One H800 machine holds 84% of the compute: no whole-machine split has a training share in [0.3, 0.4].
    assert solve_partition(cluster, PartitionRequest((1, 1), 0.3, 0.4, None), 5.0, 1, 0) is None


def test_balance_model_maximises_the_step_rate_then_saves_money():
    cluster = recipe_with_pools([("H800-PCIe", 8, 3), ("H20", 8, 4)]).cluster
    # Training on H800 stops scaling after two machines; H20 generates a little faster per machine.
    train = ((0.0, 3.0, 5.0, 5.0), (0.0, 0.5, 0.9, 1.2, 1.4))
    rollout = ((0.0, 1.0, 2.0, 3.0), (0.0, 1.2, 2.4, 3.6, 4.8))
    request = BalanceRequest((3, 4), 150.0, train, rollout)
    split, _ = solve_balance(cluster, request, 10.0, 1, 0)

    def key(s: Split):
        rate = min(sum(f[t] for f, t in zip(train, s.train, strict=True)),
                   sum(g[r] for g, r in zip(rollout, s.rollout, strict=True)))  # fmt: skip
        return (round(rate, 9), -s.cost_per_hour(cluster))

    feasible = [s for s in all_splits((3, 4)) if s.cost_per_hour(cluster) <= 150.0]
    assert key(split) == max(key(s) for s in feasible)
    assert split.train[0] <= 2  # a third H800 machine adds nothing to training


def test_a_repeated_repartition_gets_the_first_split_and_charges_its_work_again():
    """The alternation's repartitions are memoised per solve (search._balance): a repeat returns what a fresh solve
    returns and puts the same work on the search's clock, which decides where a work limit stops the search."""
    recipe = recipe_with_pools([("H800-PCIe", 8, 3), ("H20", 8, 4)])
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    ev = Evaluator(cm, recipe.cluster, recipe.workload, recipe.solver)
    train = ((0.0, 3.0, 5.0, 5.0), (0.0, 0.5, 0.9, 1.2, 1.4))
    rollout = ((0.0, 1.0, 2.0, 3.0), (0.0, 1.2, 2.4, 3.6, 4.8))
    request = BalanceRequest((3, 4), 150.0, train, rollout)
    fresh, work = solve_balance(recipe.cluster, request, 10.0, 1, 0)
    for _ in range(2):
        before = clock()
        assert _balance(ev, request, 10.0) == fresh
        assert clock() - before == pytest.approx(work, rel=1e-9)
    assert len(ev.balances) == 1 and work > 0


def test_split_space_and_moves():
    limits = (2, 1)
    splits = list(all_splits(limits))
    assert count_splits(limits) == 6 * 3  # (t, r) pairs with t + r <= m, per pool
    assert len(splits) == len(set(splits)) and all(any(s.train) and any(s.rollout) for s in splits)
    start = Split((1, 0), (0, 1))
    for n in [*start.neighbours(limits), *start.pair_neighbours(limits)]:
        assert all(t + r <= m for t, r, m in zip(n.train, n.rollout, limits, strict=True))
        assert min(n.train + n.rollout) >= 0 and n != start


def test_large_pools_move_by_strides_first():
    """The review's 10,240-GPU plan stopped 27 H100 and 53 H200 machines short of a better one: single-machine
    moves need dozens of steps there, so the local search first moves a stride of machines."""
    limits = (160, 160)
    start = Split((0, 100), (50, 0))
    moved = set(start.neighbours(limits, stride=16))
    assert Split((16, 100), (34, 0)) in moved and Split((0, 84), (50, 16)) in moved
    assert Split((1, 100), (50, 0)) not in moved
    assert all(t + r <= m for n in moved for t, r, m in zip(n.train, n.rollout, limits, strict=True))
    assert _first_stride((160, 3)) == 16 and _first_stride((15, 4)) == 1


def test_window_makespan_proportional_beats_even_split():
    fast, slow = (
        ReplicaConfig("a", 1, 1, 300.0, 8, recompute_s=2.0),
        ReplicaConfig("b", 1, 1, 100.0, 8, recompute_s=1.0),
    )
    fleet = ((fast, 2), (slow, 2))
    # Proportional: 600 of 800 samples to the fast pair (300 each), 200 to the slow pair (100 each).
    assert window_rollout_s(fleet, 800, 10.0, updates=3) == pytest.approx(
        max(300 * 10 / 300 + 6, 100 * 10 / 100 + 3)
    )
    # Even: 200 samples per replica; the slow replicas set the makespan.
    assert window_rollout_s(fleet, 800, 10.0, updates=3, even=True) == pytest.approx(200 * 10 / 100 + 3)
