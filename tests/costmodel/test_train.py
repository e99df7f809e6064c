"""Training model: memory refusals, layer split, communication terms, pipeline bubble."""

from __future__ import annotations

import math

import pytest

from areal_hex_plugin.costmodel import TrainStage
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
    est = cm.train((TrainStage("h800", 8, 1), TrainStage("h20", 8, 1)))
    assert est.feasible and sum(est.layers) == 28
    # Layers in proportion to stage compute: 8 x 756 x train_mfu(H800) vs 8 x 148 x train_mfu(H20).
    cal = cm.calibration
    h800, h20 = 756 * cal.for_gpu("H800-PCIe").train_mfu, 148 * cal.for_gpu("H20").train_mfu
    assert est.layers[0] == pytest.approx(28 * h800 / (h800 + h20), abs=1)
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
