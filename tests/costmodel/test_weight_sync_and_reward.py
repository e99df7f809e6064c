"""Weight-sync strategies and the reward cost."""

from __future__ import annotations

import pytest

from areal_hex_plugin.costmodel import RolloutStage
from tests.costmodel.helpers import cost_model

PAPER_7B = "paper/7b.yaml"


def test_broadcast_grows_with_rollout_machines_relay_barely():
    cm = cost_model(PAPER_7B)
    one = [((RolloutStage("h20", 1),), 8)]
    six = [((RolloutStage("h20", 1),), 48)]
    b1, b6 = cm.weight_sync({"h800": 8}, one), cm.weight_sync({"h800": 8}, six)
    assert 5 * b1.seconds < b6.seconds < 6 * b1.seconds  # six sends; the per-bucket overhead is paid once
    r1, r6 = cm.weight_sync({"h800": 8}, one, "relay"), cm.weight_sync({"h800": 8}, six, "relay")
    assert r1.seconds <= r6.seconds < 1.5 * r1.seconds


def test_same_pool_sync_uses_the_faster_pool_network():
    cm = cost_model(PAPER_7B)
    replicas = [((RolloutStage("h20", 2),), 4)]
    cross = cm.weight_sync({"h800": 8}, replicas)
    local = cm.weight_sync({"h20": 8}, replicas)
    assert local.seconds < cross.seconds / 2  # 5 GB/s inside the pool vs 1.5 GB/s across


def test_relay_reports_the_chain_when_the_pool_network_is_the_bottleneck():
    cm = cost_model(PAPER_7B, "hex.cluster.pools[1].inter_machine_gb_per_s=0.5")
    est = cm.weight_sync({"h800": 8}, [((RolloutStage("h20", 1),), 64)], "relay")
    assert "relay chain in pool h20" in est.bottleneck


def test_memoised_and_order_independent():
    cm = cost_model(PAPER_7B)
    a = [((RolloutStage("h20", 1),), 8), ((RolloutStage("h20", 2),), 4)]
    first = cm.weight_sync({"h800": 8}, a)
    assert cm.weight_sync({"h800": 8}, list(reversed(a))) is first


def test_unknown_strategy_is_a_programming_error():
    with pytest.raises(ValueError, match="relay"):
        cost_model(PAPER_7B).weight_sync({"h800": 8}, [((RolloutStage("h20", 1),), 1)], "teleport")


def test_nothing_to_send():
    assert cost_model(PAPER_7B).weight_sync({"h800": 8}, []).seconds == 0.0


def test_reward_seconds_spread_over_the_reward_cpus():
    cm = cost_model(PAPER_7B, "++hex.workload.reward_cpu_s_per_sample=0.5", "++hex.workload.reward_cpus=8")
    assert cm.reward_s(1024) == pytest.approx(1024 * 0.5 / 8)
    assert cost_model(PAPER_7B).reward_s(1024) == 0.0
