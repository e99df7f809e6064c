"""Weight-sync strategies and the reward cost."""

from __future__ import annotations

import pytest

from areal_hex_plugin.costmodel import RolloutStage, TrainStage
from tests.costmodel.helpers import cost_model

PAPER_7B = "paper/7b.yaml"


B7 = 15.2e9  # about one bf16 7B version


def test_pipelined_broadcast_barely_grows_with_rollout_machines():
    """NCCL pipelines a broadcast through the receiving machines: six machines cost a few chunks more than one,
    not six copies through the root's NIC."""
    cm = cost_model(PAPER_7B)
    one = [((RolloutStage("h20", 1),), 8)]
    six = [((RolloutStage("h20", 1),), 48)]
    b1, b6 = cm.weight_sync({"h800": B7}, one), cm.weight_sync({"h800": B7}, six)
    assert b1.seconds < b6.seconds < 1.01 * b1.seconds
    # The network part is the cross-type link moving the version once.
    assert b1.seconds > B7 / 1.5e9


def test_each_stage_sends_from_the_pool_that_holds_it():
    """Regression: the sender used to be whichever training pool had the most GPUs, so a small H20 stage made
    H20 the root and the H800 stages' bytes skipped the 1.5 GB/s link."""
    cm = cost_model(PAPER_7B)
    replicas = [((RolloutStage("h20", 2),), 4)]
    stages = (TrainStage("h800", 2, 1), TrainStage("h20", 4, 2))
    senders = cm.senders(stages)
    assert set(senders) == {"h800", "h20"} and senders["h800"] > senders["h20"]
    mixed = cm.weight_sync(senders, replicas)
    all_h20 = cm.weight_sync({"h20": sum(senders.values())}, replicas)
    # The H800 stages' bytes cross the 1.5 GB/s link; sending them all from H20 would take them at 5 GB/s.
    assert mixed.seconds > all_h20.seconds + senders["h800"] * (1 / 1.5e9 - 1 / 5e9) * 0.9


def test_same_pool_sync_uses_the_faster_pool_network():
    cm = cost_model(PAPER_7B)
    replicas = [((RolloutStage("h20", 2),), 4)]
    cross = cm.weight_sync({"h800": B7}, replicas)
    local = cm.weight_sync({"h20": B7}, replicas)
    assert local.seconds < cross.seconds


def test_relay_copies_once_per_pool_and_chains_inside_it():
    cm = cost_model(PAPER_7B, "hex.cluster.pools.1.inter_machine_gb_per_s=0.5")
    slow_chain = cm.weight_sync({"h800": B7}, [((RolloutStage("h20", 1),), 64)], "relay")
    fast = cost_model(PAPER_7B).weight_sync({"h800": B7}, [((RolloutStage("h20", 1),), 64)], "relay")
    # Root: one copy over 1.5 GB/s. Chain: seven hops of one 1 GiB bucket each; at 0.5 GB/s the chain, not the
    # root's copy, is the slow part, and the two overlap (pipelined), so only the excess shows.
    chain, root = 7 * 2**30 / 0.5e9, B7 / 1.5e9
    assert slow_chain.seconds - fast.seconds == pytest.approx(chain - root, rel=0.01)
    assert "network" in slow_chain.bottleneck


def test_memoised_and_order_independent():
    cm = cost_model(PAPER_7B)
    a = [((RolloutStage("h20", 1),), 8), ((RolloutStage("h20", 2),), 4)]
    first = cm.weight_sync({"h800": B7}, a)
    assert cm.weight_sync({"h800": B7}, list(reversed(a))) is first


def test_unknown_strategy_is_a_programming_error():
    with pytest.raises(ValueError, match="relay"):
        cost_model(PAPER_7B).weight_sync({"h800": B7}, [((RolloutStage("h20", 1),), 1)], "teleport")


def test_nothing_to_send():
    assert cost_model(PAPER_7B).weight_sync({"h800": B7}, []).seconds == 0.0


def test_reward_seconds_spread_over_the_reward_cpus():
    cm = cost_model(PAPER_7B, "++hex.workload.reward_cpu_s_per_sample=0.5", "++hex.workload.reward_cpus=8")
    assert cm.reward_s(1024) == pytest.approx(1024 * 0.5 / 8)
    assert cost_model(PAPER_7B).reward_s(1024) == 0.0
