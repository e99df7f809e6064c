"""Rollout replica model: feasibility reasons, memory, bounds, and the shape of the throughput curve."""

from __future__ import annotations

import dataclasses

import pytest

from areal_hex_plugin.costmodel import CostModel, RolloutStage
from tests.costmodel.helpers import cost_model, recipe

PAPER_7B = "paper/7b.yaml"
# The paper's length shape without its point mass at the cap: the mean in-flight context stays 3,212 tokens, so
# the KV pool holds more sequences than SGLang's CUDA-graph limit.
NO_CAP_MASS = "hex.workload.output_lengths.cap_share=0"
MIX_4090 = "mixes/h100_rtx4090_qwen3-4b.yaml"


def test_weights_that_fill_the_gpu_are_refused_with_the_numbers():
    cm = cost_model(MIX_4090, "++hex.workload.model=Qwen2.5-14B")
    est = cm.rollout((RolloutStage("rtx4090", 1),))
    assert not est.feasible and est.tokens_per_s == 0.0
    assert est.reason.startswith(
        "14B at TP1 on RTX4090: 29.5 GB weights per GPU leave no room for a KV cache"
    )


def test_kv_cache_smaller_than_one_longest_sequence_is_refused():
    cm = cost_model(MIX_4090, "++hex.workload.model=Llama-3.1-8B", "gconfig.max_new_tokens=32768")
    est = cm.rollout((RolloutStage("rtx4090", 1),))
    assert not est.feasible
    assert "GB weights leave" in est.reason and "fewer than 1 sequence of 33k tokens" in est.reason
    # Splitting the weights over two GPUs frees room for the cache.
    assert cm.rollout((RolloutStage("rtx4090", 2),)).feasible


@pytest.mark.parametrize(
    ("stages", "words"),
    [
        ((RolloutStage("h20", 3),), "does not divide"),
        ((RolloutStage("h20", 16),), "does not fit one h20 machine"),
        ((RolloutStage("nope", 1),), "unknown pool 'nope'"),
        ((), "at least one stage"),
        (tuple(RolloutStage("h20", 1) for _ in range(29)), "29 pipeline stages for 28 layers"),
    ],
)
def test_impossible_shapes_are_infeasible_not_errors(stages, words):
    est = cost_model(PAPER_7B).rollout(stages)
    assert not est.feasible and words in est.reason


def test_results_are_frozen_and_memoised():
    cm = cost_model(PAPER_7B)
    stages = (RolloutStage("h20", 2),)
    first = cm.rollout(stages)
    assert cm.rollout(stages) is first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.tokens_per_s = 1.0  # type: ignore[misc]


def test_memory_and_concurrency_are_consistent():
    cm = cost_model(PAPER_7B)
    est = cm.rollout((RolloutStage("h800", 1),))
    assert est.feasible and est.gpus == {"h800": 1}
    assert est.weights_gb_per_gpu == pytest.approx(15.23, abs=0.01)  # 7.6B bf16 parameters
    # GQA: 4 KV heads x 128 dims x 28 layers x K and V x 2 bytes = 57,344 bytes per token.
    assert est.kv_capacity_tokens == pytest.approx(est.kv_gb_per_gpu * 1e9 / 57344, rel=1e-3)
    assert 1 <= est.concurrency <= 256  # SGLang's CUDA-graph batch limit below TP4
    # A caller's cap (the planner's share of the staleness bound) cuts the batch, and with it the speed.
    capped = cm.rollout((RolloutStage("h800", 1),), max_sequences=16)
    assert capped.concurrency == 16 and capped.tokens_per_s < est.tokens_per_s


def test_batch_stays_within_sglangs_cuda_graph_limit():
    # Room for ~1,000 7B sequences per H20 at TP1 and far more at TP4, but SGLang captures CUDA graphs only up to
    # 256 sequences below TP4 and 512 from TP4 on (cards of 60 GB and more); a 24 GB card stops at 24 below TP4.
    cm = cost_model(PAPER_7B, "rollout.max_concurrent_rollouts=null", NO_CAP_MASS)
    tp1 = cm.rollout((RolloutStage("h20", 1),))
    assert tp1.kv_capacity_tokens / 3212 > 256 and tp1.concurrency == 256
    assert cm.rollout((RolloutStage("h20", 4),)).concurrency == 512
    assert cm.rollout((RolloutStage("h20", 1), RolloutStage("h800", 4))).concurrency == 256
    small = cost_model(MIX_4090, "++hex.workload.model=Qwen2.5-1.5B", "rollout.max_concurrent_rollouts=null")
    assert small.rollout((RolloutStage("rtx4090", 1),)).concurrency == 24


def test_a_rollouts_samples_share_one_prompt_prefill():
    # The same 256 sequences as 16 rollouts of 16 samples (radix cache: 16 prefills) or 256 rollouts of one.
    cm = cost_model(PAPER_7B, NO_CAP_MASS)
    grouped = cm.rollout((RolloutStage("h20", 1),))
    single = cost_model(PAPER_7B, "gconfig.n_samples=1", NO_CAP_MASS).rollout((RolloutStage("h20", 1),))
    assert grouped.concurrency == single.concurrency == 256
    assert grouped.peak_tokens_per_s == pytest.approx(single.peak_tokens_per_s)
    tokens = 256 * cm.workload.output_lengths.mean
    prefill_grouped = tokens / grouped.tokens_per_s - tokens / grouped.peak_tokens_per_s
    prefill_single = tokens / single.tokens_per_s - tokens / single.peak_tokens_per_s
    assert prefill_grouped > 0
    assert prefill_single == pytest.approx(16 * prefill_grouped, rel=0.02)


def test_h20_decode_is_compute_bound_and_h800_bandwidth_bound():
    """With the generic factors (not the paper fit) the roofline alone: H20's 37 FLOP/byte vs H800's 378."""
    r = recipe(PAPER_7B)
    cm = CostModel(r.cluster, r.workload)
    assert cm.rollout((RolloutStage("h20", 1),)).bound == "compute"
    assert cm.rollout((RolloutStage("h800", 2),)).bound == "hbm"


def test_a_synchronous_step_keeps_its_replicas_full_until_its_samples_run_out():
    """At eta = 0 the step's samples queue at each replica and enter as slots free, so the replica decodes at
    the rate it keeps at eta >= 1 and only the step's end drains (``drain_s``). Before, every batch of the
    in-flight cap was charged a drain from its start: 0.8x the eta = 8 rate or less."""
    cm = cost_model(PAPER_7B, NO_CAP_MASS)
    est = cm.rollout((RolloutStage("h800", 1),))
    assert est.tokens_per_s < est.peak_tokens_per_s  # prefill
    sync = cost_model(PAPER_7B, "rollout.max_head_offpolicyness=0", NO_CAP_MASS).rollout(
        (RolloutStage("h800", 1),), est.concurrency
    )
    assert sync.tokens_per_s == pytest.approx(est.tokens_per_s)
    assert 0 < sync.drain_s < sync.longest_s


def test_a_longer_tail_lowers_throughput():
    base = cost_model(PAPER_7B).rollout((RolloutStage("h20", 1),))
    tail = cost_model(PAPER_7B, "hex.workload.output_lengths.sigma=1.4").rollout((RolloutStage("h20", 1),))
    assert tail.tokens_per_s < base.tokens_per_s


def test_pipeline_across_pools_splits_layers_by_capability():
    cm = cost_model(PAPER_7B)
    est = cm.rollout((RolloutStage("h20", 2), RolloutStage("h800", 1)))
    assert est.feasible and est.gpus == {"h20": 2, "h800": 1}
    assert sum(est.layers) == 28 and est.layers[0] > est.layers[1]
    # The cross-pool hand-off (1.5 GB/s) makes this slower per GPU than the same GPUs as separate replicas.
    separate = (
        2 * cm.rollout((RolloutStage("h20", 1),)).tokens_per_s
        + cm.rollout((RolloutStage("h800", 1),)).tokens_per_s
    )
    assert est.tokens_per_s < separate
