"""With default calibration the models reproduce the paper's measured ratios (paper.md §5.3, §5.5)."""

from __future__ import annotations

import pytest

from areal_hex_plugin.costmodel import RolloutStage
from areal_hex_plugin.costmodel.single_type import best_rollout, best_train
from tests.costmodel.helpers import cost_model, recipe

MODELS = ("1.5b", "7b", "14b")


def _per_gpu(model: str, pool: str) -> tuple[float, float]:
    r = recipe(f"paper/{model}.yaml")
    cm = cost_model(f"paper/{model}.yaml")
    _, roll = best_rollout(cm, r.cluster.pool(pool), r.hex.solver.max_pp_stages)
    _, train = best_train(cm, r.cluster.pool(pool), r.hex.solver.max_pp_stages)
    assert roll.feasible and train.feasible
    return roll.tokens_per_s / roll.n_gpus, train.tokens_per_s / train.n_gpus


@pytest.mark.parametrize("model", MODELS)
def test_table1_per_gpu_ratios_h20_over_h800(model):
    h20_roll, h20_train = _per_gpu(model, "h20")
    h800_roll, h800_train = _per_gpu(model, "h800")
    # Table 1: H20 is 2.72x cheaper per rollout token and 3.12x dearer per training token at prices
    # 1.85 vs 5.28, i.e. per-GPU throughput ratios of about 0.95 (rollout) and 0.11 (training).
    assert h20_roll / h800_roll == pytest.approx(0.95, rel=0.15)
    assert h20_train / h800_train == pytest.approx(0.11, rel=0.30)


# Table 2, AReaL-Hex column: seconds per weight update over the 1.5 GB/s H800 -> H20 link.
TABLE2 = {"1.5b": 10.06, "7b": 58.34, "14b": 112.93}


@pytest.mark.parametrize("model", MODELS)
def test_table2_naive_broadcast_lands_in_the_paper_range(model):
    cm = cost_model(f"paper/{model}.yaml")
    # The paper's 56-GPU setting: one H800 machine trains, 49 H20 (6 full machines) generate at TP1.
    replicas = [((RolloutStage("h20", 1),), 48)]
    naive = cm.weight_sync({"h800": 8}, replicas, "broadcast")
    measured = TABLE2[model]
    # 7B and 14B scale with bytes x receiving machines; the 1.5B point is lower than bytes predict
    # (Table 2's 1.5B/7B ratio is 1/5.8, the weight-bytes ratio 1/4.3), so it gets a wider band.
    assert naive.seconds == pytest.approx(measured, rel=0.15 if model != "1.5b" else 0.5)
    assert "h800->h20" in naive.bottleneck
    relay = cm.weight_sync({"h800": 8}, replicas, "relay")
    assert relay.seconds < naive.seconds / 3
    assert relay.bytes == naive.bytes
