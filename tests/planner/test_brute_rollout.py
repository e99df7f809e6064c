"""Issue 14, item 4: the brute force's rollout side, every fleet and the best integer split of the samples."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from itertools import product

from areal_hex_plugin.planner.brute_rollout import pool_fleets, reaches
from areal_hex_plugin.planner.inflight import best_split, window_rollout_s
from areal_hex_plugin.planner.inflight import reaches as split_reaches
from areal_hex_plugin.planner.rollout_model import ReplicaConfig


def makespan(groups, shares, mean):
    return max(
        math.ceil(x / y) * mean / c.tokens_per_s + c.recompute_s
        for (c, y), x in zip(groups, shares, strict=True)
    )


def _random_groups(rng: random.Random, most: int) -> tuple[tuple[ReplicaConfig, int], ...]:
    """1 to ``most`` groups of 1-3 replicas of random speed, some with a KV rebuild time."""
    return tuple(
        (
            ReplicaConfig("p", 1, 1, rng.uniform(50, 900), 64, rng.choice((0.0, rng.uniform(0, 30)))),
            rng.randint(1, 3),
        )
        for _ in range(rng.randint(1, most))
    )


def test_best_split_is_the_least_makespan_of_every_integer_split():
    rng = random.Random(3)
    for _ in range(60):
        groups = _random_groups(rng, 3)
        samples, mean = rng.randint(len(groups), 14), rng.uniform(100, 2000)
        splits = [x for x in product(range(1, samples + 1), repeat=len(groups)) if sum(x) == samples]
        time, shares = best_split(groups, samples, mean)
        assert sum(shares) == samples and min(shares) >= 1
        assert makespan(groups, shares, mean) == time == min(makespan(groups, x, mean) for x in splits)


def test_best_split_is_the_least_group_time_that_reaches_with_long_samples_and_large_windows():
    """best_split's shortcuts (one group: the time of ceil(samples / y) samples each; several: each group's count
    within a time read off its own candidate times) give the least group time that ``reaches``, scanned in full,
    where replicas wait for a longest sample (flat group times) and windows hold hundreds of samples."""
    rng = random.Random(11)
    for _ in range(100):
        groups = tuple(
            (replace(c, longest_s=rng.choice((0.0, rng.uniform(0, 600)))), y)
            for c, y in _random_groups(rng, 3)
        )
        samples, mean = rng.randint(len(groups), 300), rng.uniform(100, 2000)
        time, shares = best_split(groups, samples, mean)
        times = (
            max(k * mean / c.tokens_per_s, c.longest_s) + c.recompute_s
            for c, _ in groups
            for k in range(1, samples + 1)
        )
        assert time == min(t for t in times if split_reaches(groups, samples, mean, t))
        assert sum(shares) == samples and min(shares) >= 1
        assert (
            max(
                max(math.ceil(x / y) * mean / c.tokens_per_s, c.longest_s) + c.recompute_s
                for (c, y), x in zip(groups, shares, strict=True)
            )
            == time
        )


def test_shares_in_proportion_to_speed_are_not_the_best_split():
    """Review: the brute force split samples in proportion to replica speed, blind to the KV rebuild."""
    fast = ReplicaConfig("p", 4, 1, 1000.0, 64, recompute_s=40.0)
    slow = ReplicaConfig("p", 1, 1, 500.0, 64, recompute_s=0.0)
    groups = ((fast, 1), (slow, 1))
    proportional = window_rollout_s(groups, 300, 100.0, updates=1)
    time, shares = best_split(groups, 300, 100.0)
    assert time < proportional and shares != (200, 100)


def test_pool_fleets_are_every_multiset_on_exactly_those_machines():
    shapes = [ReplicaConfig("p", tp, 1, 100.0 * tp, 8) for tp in (1, 2, 4)]
    fleets = pool_fleets(shapes, 2, 4, one_shape=False)
    # 5..8 GPUs as a + 2b + 4c
    expected = {(a, b, c) for a in range(9) for b in range(5) for c in range(3) if 4 < a + 2 * b + 4 * c <= 8}
    got = {tuple(dict((s.tp, y) for s, y in f).get(tp, 0) for tp in (1, 2, 4)) for f in fleets}
    assert got == expected and len(fleets) == len(expected)
    assert any(len(f) == 3 for f in fleets)  # three shapes in one pool
    assert all(len(f) == 1 for f in pool_fleets(shapes, 2, 4, one_shape=True))


def test_reaches_is_true_exactly_from_the_best_split_makespan_on():
    """The brute force skips caps under which ``reaches`` is false: it must be false only below the optimum."""
    rng = random.Random(5)
    for _ in range(200):
        groups = _random_groups(rng, 4)
        samples, mean = rng.randint(len(groups), 200), rng.uniform(100, 2000)
        time = best_split(groups, samples, mean)[0]
        assert reaches(groups, samples, mean, time)
        assert not reaches(groups, samples, mean, time * (1 - 1e-6))
