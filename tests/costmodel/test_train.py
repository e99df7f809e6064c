"""Training model: memory refusals, layer split, communication terms, pipeline bubble."""

from __future__ import annotations

import math

import pytest

from areal_hex_plugin.costmodel import TrainStage
from areal_hex_plugin.costmodel.memory import GB, megatron_state_bytes, stage_params, train_state_bytes
from areal_hex_plugin.costmodel.train import _Step, estimate_train
from tests.costmodel.helpers import cost_model

PAPER_7B = "paper/7b.yaml"
PAPER_14B = "paper/14b.yaml"


def test_unsharded_14b_state_does_not_fit_one_gpu():
    est = cost_model(PAPER_14B).train((TrainStage("h800", 1, 1),))
    assert not est.feasible and math.isinf(est.step_time_s) and est.tokens_per_s == 0.0
    assert "training, the trainer (dp=1, tp=1, 48 layers) on H800-PCIe: needs" in est.reason
    assert "GB per GPU" in est.reason and "72.0 GB usable" in est.reason


def test_sharding_over_more_gpus_lowers_memory_per_gpu():
    cm = cost_model(PAPER_14B)
    small, large = cm.train((TrainStage("h20", 8, 1),)), cm.train((TrainStage("h20", 16, 1),))
    assert small.memory_gb_per_gpu[0] > large.memory_gb_per_gpu[0]


def test_step_time_and_breakdown():
    cm = cost_model(PAPER_7B)
    est = cm.train((TrainStage("h800", 8, 1),))
    assert est.feasible and est.gpus == {"h800": 8} and est.layers == (28,)
    assert est.tokens_per_s == pytest.approx(cm.workload.tokens_per_step / est.step_time_s)
    # 8 GPUs of one machine: FSDP traffic over NVLink hides behind compute.
    assert est.breakdown["compute"] > est.breakdown["dp_comm"] > 0
    assert est.breakdown["tp_comm"] == 0 and est.breakdown["bubble"] == 0
    # Compute is 6-8 x params x tokens FLOPs plus attention and the log-prob pass at the H800's MFU.
    flops = 8 * 7.6e9 * cm.workload.tokens_per_step
    peak = 8 * 756e12 * cm.calibration.for_gpu("H800-PCIe").train_mfu
    assert flops / peak < est.breakdown["compute"] < 2 * flops / peak


def test_fsdp_across_machines_pays_for_the_slow_network():
    cm = cost_model(PAPER_7B)
    one = cm.train((TrainStage("h800", 8, 1),))
    two = cm.train((TrainStage("h800", 16, 1),))
    assert two.breakdown["dp_comm"] > 10 * one.breakdown["dp_comm"]


def test_layers_follow_stage_compute_and_pipeline_adds_a_bubble():
    cm = cost_model(PAPER_7B)
    stages = (TrainStage("h800", 8, 1), TrainStage("h20", 8, 1))
    est = cm.train(stages)
    assert est.feasible and sum(est.layers) == 28
    # Layers in proportion to stage compute: 8 x 756 x train_mfu(H800) vs 8 x 148 x train_mfu(H20).
    cal = cm.calibration
    h800, h20 = 756 * cal.for_gpu("H800-PCIe").train_mfu, 148 * cal.for_gpu("H20").train_mfu
    proportional = round(28 * h800 / (h800 + h20))
    # The last stage also computes the LM head: it gets no more than its share of the decoder layers.
    assert est.layers[0] >= proportional
    even = estimate_train(cm.cluster, cm.workload, cal, stages, layers=(proportional, 28 - proportional))
    assert est.step_time_s <= even.step_time_s
    assert est.breakdown["bubble"] > 0 and est.breakdown["pp_comm"] > 0


@pytest.mark.parametrize(
    ("stages", "words"),
    [
        ((TrainStage("h800", 1, 16),), "does not fit one h800 machine"),
        ((TrainStage("h800", 64, 1),), "needs 64 GPUs of pool h800, which has 32"),
        ((TrainStage("h800", 0, 1),), "at least 1"),
        ((TrainStage("x", 1, 1),), "unknown pool"),
    ],
)
def test_impossible_layouts_are_infeasible_not_errors(stages, words):
    est = cost_model(PAPER_7B).train(stages)
    assert not est.feasible and words in est.reason


@pytest.mark.parametrize(
    "stages",
    [
        (TrainStage("h800", 8, 1), TrainStage("h800", 8, 1)),
        (TrainStage("h800", 4, 2), TrainStage("h20", 8, 1), TrainStage("h20", 8, 1)),
        (TrainStage("h20", 4, 1), TrainStage("h800", 8, 1), TrainStage("h800", 8, 1)),
    ],
)
def test_the_layer_split_is_the_best_of_every_split(stages):
    """Uneven stages (Megatron runs the plan's layer count per stage): no composition of the layers is faster."""
    cm = cost_model(PAPER_7B)
    chosen = cm.train(stages)
    every = [
        estimate_train(cm.cluster, cm.workload, cm.calibration, stages, layers=split)
        for split in _compositions(cm.workload.model.layers, len(stages))
    ]
    fastest = min(e.step_time_s for e in every if e.feasible)
    assert chosen.feasible and chosen.step_time_s == pytest.approx(fastest, rel=1e-12)


def test_stages_of_one_type_differ_to_absorb_the_lm_head():
    cm = cost_model(PAPER_7B)
    stages = (TrainStage("h800", 8, 1), TrainStage("h800", 8, 1))
    est = cm.train(stages)
    assert est.layers[0] > est.layers[1]  # the last stage also computes the LM head
    even = estimate_train(cm.cluster, cm.workload, cm.calibration, stages, layers=(14, 14))
    assert est.step_time_s < even.step_time_s


def _compositions(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


@pytest.mark.parametrize("hybrid", [False, True])
def test_stage_costs_are_affine_in_the_layers_as_the_split_assumes(hybrid):
    cm = cost_model(PAPER_7B)
    stages = (
        ((TrainStage("h800", 16, 1, hybrid=True),),)
        if hybrid
        else ((TrainStage("h800", 8, 1), TrainStage("h20", 16, 2), TrainStage("h20", 8, 1)),)
    )[0]
    step = _Step(cm.cluster, cm.workload, cm.calibration, stages)
    for i in range(len(stages)):
        for n in range(1, 25):
            layers = tuple(n if j == i else 1 for j in range(len(stages)))
            direct = step._stage(i, n, stage_params(cm.workload.model, layers)[i])
            assert step._cost(i, n).parts == pytest.approx(direct, rel=1e-9)


def test_a_one_stage_megatron_layout_is_costed_as_megatron_not_fsdp():
    """``megatron:d32p1t1`` keeps bf16 parameters and fp32 gradients whole on every rank (the distributed
    optimizer shards only the fp32 master and Adam state) and syncs once per optimizer step, whatever its depth."""
    fsdp, megatron = (
        cost_model(PAPER_7B, "++hex.workload.model=Qwen2.5-32B", f"actor.backend={b}:d8")
        for b in ("fsdp", "megatron")
    )
    stages = (TrainStage("h800", 32, 1),)
    step = {
        name: estimate_train(cm.cluster, cm.workload, cm.calibration, stages, check_memory=False)
        for name, cm in (("fsdp", fsdp), ("megatron", megatron))
    }
    model = megatron.workload.model
    params = stage_params(model, (model.layers,))[0]
    state = {
        "fsdp": train_state_bytes(params, model, model.layers, 32, 1),
        "megatron": megatron_state_bytes(params, model, model.layers, 32, 1),
    }
    assert state["megatron"] / GB > 190  # 32B: about 6 bytes per parameter on every rank
    assert step["megatron"].memory_gb_per_gpu[0] - step["fsdp"].memory_gb_per_gpu[0] == pytest.approx(
        (state["megatron"] - state["fsdp"]) / GB
    )
    refused = megatron.train(stages)
    assert not refused.feasible and "needs" in refused.reason and "GB usable" in refused.reason
    # Per minibatch: FSDP gathers bf16 twice and reduce-scatters fp32 per micro-batch, and gathers once per
    # forward-only pass; the distributed optimizer reduce-scatters fp32 and gathers bf16 once.
    micro = _Step(fsdp.cluster, fsdp.workload, fsdp.calibration, stages).micro[0]
    ratio = micro * (2 * 2 + 4 + 2 * fsdp.workload.rl.forward_passes) / (4 + 2)
    assert step["fsdp"].breakdown["dp_comm"] / step["megatron"].breakdown["dp_comm"] == pytest.approx(ratio)


def test_hybrid_sharding_is_refused_for_a_megatron_actor():
    cm = cost_model(PAPER_7B, "actor.backend=megatron:d8")
    est = cm.train((TrainStage("h800", 16, 1, hybrid=True),))
    assert not est.feasible and "actor.backend=megatron runs on Megatron" in est.reason
