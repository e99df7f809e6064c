"""What AReaL 1.0.4 runs per step, read from the recipe: each mechanism moves the estimate the way upstream's and
SGLang's code says (citations in costmodel/rollout.py, memory.py, train.py, weightsync.py)."""

from __future__ import annotations

import pytest

from areal_hex_plugin.costmodel import RolloutStage, TrainStage
from areal_hex_plugin.costmodel.memory import ENGINE_CONTEXT_BYTES, kv_bytes_per_token
from areal_hex_plugin.costmodel.train import estimate_train
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.rental import rent
from tests.costmodel.helpers import cost_model, recipe

PAPER_14B = "paper/14b.yaml"
PAPER_7B = "paper/7b.yaml"


def test_kv_pool_is_what_mem_fraction_static_leaves():
    """SGLang's pool: mem_fraction_static x HBM - weights - context (the recipes run 0.8, not 90% - 2 GB)."""
    est = cost_model(PAPER_14B).rollout((RolloutStage("h800", 1),))
    r = recipe(PAPER_14B)
    assert r.workload.rl.mem_fraction_static == 0.8
    weights = r.workload.model.weight_bytes()
    expected = 0.8 * 80e9 - ENGINE_CONTEXT_BYTES - est.weights_gb_per_gpu * 1e9
    assert est.kv_gb_per_gpu == pytest.approx(expected / 1e9, rel=1e-6)
    per_token = kv_bytes_per_token(r.workload.model, 48, 1)
    assert est.kv_capacity_tokens == int(expected / per_token)
    assert weights > 0
    # More of the GPU for SGLang: a bigger pool, more sequences in flight on the KV-bound 14B replica.
    roomy = cost_model(PAPER_14B, "sglang.mem_fraction_static=0.9").rollout((RolloutStage("h800", 1),))
    assert roomy.kv_capacity_tokens > est.kv_capacity_tokens and roomy.concurrency > est.concurrency


def test_a_bad_mem_fraction_is_refused_naming_the_field():
    from areal_hex_plugin.errors import HexError

    with pytest.raises(HexError, match="sglang.mem_fraction_static"):
        recipe(PAPER_7B, "sglang.mem_fraction_static=1.5")


def _timed(name: str, *overrides: str):
    """The training estimate on one H800 machine, memory unchecked."""
    cm = cost_model(name, *overrides)
    return estimate_train(cm.cluster, cm.workload, cm.calibration, (TrainStage("h800", 8, 1),), False)


def test_micro_batches_come_from_mb_spec():
    small = _timed(PAPER_7B, "actor.mb_spec.max_tokens_per_mb=4096")
    big = _timed(PAPER_7B, "actor.mb_spec.max_tokens_per_mb=65536")
    # A micro-batch holds at least the longest sequence (28k tokens), so 4096 means one sequence each; the bigger
    # micro-batch needs more activation memory and fewer FSDP gathers.
    assert big.memory_gb_per_gpu[0] > small.memory_gb_per_gpu[0]
    assert big.breakdown["dp_comm"] < small.breakdown["dp_comm"]


def test_gradient_checkpointing_costs_one_more_forward_and_saves_memory():
    on = _timed("paper/1.5b.yaml")
    off = _timed("paper/1.5b.yaml", "actor.gradient_checkpointing=false")
    assert off.memory_gb_per_gpu[0] > 72 > on.memory_gb_per_gpu[0]  # without it 1.5B no longer fits an H800
    assert (
        not cost_model("paper/1.5b.yaml", "actor.gradient_checkpointing=false")
        .train((TrainStage("h800", 8, 1),))
        .feasible
    )
    # forward + backward (3) + recompute (1) + log-prob forward (1): 5 passes with, 4 without.
    assert on.breakdown["compute"] / off.breakdown["compute"] == pytest.approx(5 / 4, rel=1e-6)


def test_logprob_recompute_is_a_forward_pass():
    stages = (TrainStage("h800", 8, 1),)
    on = cost_model(PAPER_7B).train(stages)
    off = cost_model(PAPER_7B, "actor.recompute_logprob=false", "actor.use_decoupled_loss=false").train(
        stages
    )
    assert on.breakdown["compute"] / off.breakdown["compute"] == pytest.approx(5 / 4, rel=1e-6)


def test_the_log_prob_phase_is_what_the_forward_only_pass_adds():
    """Upstream times the proximal log-prob pass apart from the update (``timeperf/recompute_logp`` before
    ``timeperf/train_step``): the model's share of it is what the pass adds to the step, worked out by pricing
    the step without it (one GPU: no data-parallel traffic for the pass to hide behind); with no pass it is 0.
    The 14B TP layout checks the pass's TP all-reduces are in the phase too."""
    for name, stages in ((PAPER_7B, (TrainStage("h800", 1, 1),)), (PAPER_14B, (TrainStage("h800", 1, 8),))):
        on, off = (
            estimate_train(cm.cluster, cm.workload, cm.calibration, stages, check_memory=False)
            for cm in (
                cost_model(name),
                cost_model(name, "actor.recompute_logprob=false", "actor.use_decoupled_loss=false"),
            )
        )
        assert on.logp_s > 0
        assert on.logp_s == pytest.approx(on.step_time_s - off.step_time_s, rel=1e-6)
        assert off.logp_s == 0


def test_a_training_step_has_no_fixed_seconds():
    """Every second of a step is named work: FLOPs, traffic over a link, the optimizer through HBM."""
    cm = cost_model(PAPER_7B)
    est = cm.train((TrainStage("h800", 8, 1),))
    b = est.breakdown
    assert set(b) == {"compute", "tp_comm", "dp_comm", "optimizer", "pp_comm", "bubble"}
    assert est.step_time_s == pytest.approx(max(b["compute"] + b["tp_comm"], b["dp_comm"]) + b["optimizer"])
    with pytest.raises(HexError, match="train_fixed_s"):
        cost_model(PAPER_7B, "++hex.calibration.gpu_types.H20.train_fixed_s=5")


def test_weight_update_rebuilds_every_in_flight_context():
    """Upstream aborts in-flight requests with the update, SGLang flushes its cache and the client resubmits
    prompt + generated tokens: the rebuild is the in-flight context at the prefill rate, dense FLOPs per token
    plus causal attention over it (each sequence attends over half its context on average)."""
    cm = cost_model(PAPER_7B)
    est = cm.rollout((RolloutStage("h20", 1),))
    r = recipe(PAPER_7B)
    prompts = -(-est.concurrency // r.workload.rl.n_samples)
    position = r.workload.output_lengths.mean_square / (2 * r.workload.output_lengths.mean)
    tokens = prompts * r.workload.prompt_tokens + est.concurrency * position
    model, pool = r.workload.model, cm.cluster.pool("h20")
    flops = pool.gpu.flops * cm.calibration.for_gpu("H20").infer_mfu
    ctx = r.workload.prompt_tokens + position
    attention = est.concurrency * ctx * ctx / 2 * 4 * model.heads * model.dim_per_head * model.layers / flops
    assert est.recompute_s == pytest.approx(tokens * est.prefill_s_per_token + attention, rel=1e-9)


def test_renting_by_the_gpu_keeps_the_remainder_on_one_machine():
    cluster = rent(recipe(PAPER_7B).cluster, {"H800-PCIe": 6, "H20": 50})
    sizes = {p.name: (p.gpus_per_machine, p.machines) for p in cluster.pools}
    assert sizes == {"h800-part": (6, 1), "h20": (8, 6), "h20-part": (2, 1)}
    assert cluster.price_per_hour == pytest.approx(6 * 5.28 + 50 * 1.85)
    assert cluster.link_gb_per_s("h20", "h20-part") == 5.0
    assert cluster.link_gb_per_s("h800-part", "h20-part") == 1.5
