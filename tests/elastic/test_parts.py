"""The elastic run's three parts, each on its own: the servers' health, their shares and length drift."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.areal.elastic.drift import DriftAdvisor  # noqa: E402
from areal_hex_plugin.areal.elastic.health import DOWN, JOINING, UP, ServerHealth  # noqa: E402
from areal_hex_plugin.areal.elastic.shares import SharePolicy  # noqa: E402
from areal_hex_plugin.costmodel import CostModel  # noqa: E402
from areal_hex_plugin.planner.reshare import ServerShape  # noqa: E402
from areal_hex_plugin.specs.config import ElasticConfig  # noqa: E402
from tests.elastic.plans import elastic_recipe  # noqa: E402

CONFIG = ElasticConfig(health_interval_s=0.2, health_timeout_s=0.5, failures_to_down=3, drift_min_samples=4)
SHAPES = [ServerShape("big", 1), ServerShape("small", 2)]


def _health(answers: dict[str, list[bool]]) -> ServerHealth:
    """Health over servers whose probes answer in turn as ``answers`` lists (the network, not our code)."""
    return ServerHealth(CONFIG, list(answers), lambda address, timeout: answers[address].pop(0))


def test_a_server_is_down_after_failures_to_down_failed_probes_in_a_row() -> None:
    health = _health({"a": [False, False, True, False, False, False], "b": [True] * 6})
    downs = []
    for _ in range(6):
        for rank in health.to_probe():
            if health.record(rank, health.probe(rank)):
                downs.append(rank)
                health.mark_down(rank)
    # a fails twice, answers once (the count starts again), then fails three times: down at its 6th probe only.
    assert downs == [0]
    assert health.states == [DOWN, UP] and health.live() == [False, True]
    assert health.to_probe() == [1]


def test_the_deadline_is_failures_to_down_probe_rounds_each_a_wait_and_a_timeout() -> None:
    assert _health({"a": []}).deadline_s == pytest.approx(3 * (0.2 + 0.5))  # 2.1 s


def test_a_relaunched_or_joined_server_joins_until_it_serves() -> None:
    health = _health({"a": [False] * 3, "b": []})
    for _ in range(3):
        health.record(0, health.probe(0))
    detection = health.mark_down(0)
    assert detection.rank == 0 and detection.first_failure <= detection.marked
    health.relaunched(0, "a2")
    assert health.states == [JOINING, UP] and health.addresses[0] == "a2" and health.failures[0] == 0
    assert health.add("c") == 2 and health.states[2] == JOINING and not health.live()[2]


@pytest.fixture(scope="module")
def cost_model():
    recipe = elastic_recipe()
    return CostModel(recipe.cluster, recipe.workload, recipe.calibration)


def test_a_lost_server_gives_all_its_share_to_the_one_left(cost_model) -> None:
    handed = []
    policy = SharePolicy(cost_model, SHAPES, handed.append)
    policy.resolve([True, True])
    both = policy.shares
    assert sum(both) == pytest.approx(1.0) and all(s > 0 for s in both)
    policy.resolve([True, False])
    assert policy.shares == (1.0, 0.0) and list(handed[-1]) == [1.0, 0.0]
    assert policy.reshares == 2
    policy.resolve([False, False])  # nothing serves: the router keeps what it has
    assert policy.reshares == 2
    assert policy.tokens_per_s([False, False]) == 0.0
    # The fleet of both makes more tokens per second than either server alone.
    assert policy.tokens_per_s([True, True]) > max(
        policy.tokens_per_s([True, False]), policy.tokens_per_s([False, True])
    )


def test_a_server_that_joins_has_no_share_until_the_shares_are_resolved(cost_model) -> None:
    policy = SharePolicy(cost_model, SHAPES[:1], lambda shares: None)
    policy.resolve([True])
    policy.add(SHAPES[1])
    assert policy.shares == (1.0, 0.0)
    policy.resolve([True, True])
    assert policy.shares[1] > 0


def test_drift_needs_enough_samples_then_moves_with_the_lengths(cost_model, tmp_path: Path) -> None:
    advisor = DriftAdvisor(0.2, min_samples=4, lengths_file=str(tmp_path / "lengths.txt"))
    live = [True, True]
    assert advisor.check(cost_model, SHAPES, live, [12, 12, 12], step=0) is None  # 3 < 4 samples
    mean = cost_model.workload.output_lengths.mean  # about 12 tokens
    steady = advisor.check(cost_model, SHAPES, live, [round(mean)] * 64, step=1)
    assert steady is not None and not advisor.moved()
    doubled = advisor.check(cost_model, SHAPES, live, [2 * round(mean)] * 64, step=2)
    assert doubled is not None and advisor.moved() and advisor.change > 0.2
    # Served at 22 tokens, read under the recipe's cap (gconfig.max_new_tokens=16).
    assert doubled.measured.workload.output_lengths.mean == pytest.approx(16.0)
    advisor.advise(doubled, [24] * 4)
    assert (tmp_path / "lengths.txt").read_text().split() == ["24"] * 4
