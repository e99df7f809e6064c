"""The cost model's decode step reads measured kernel data where it covers the replica, the roofline elsewhere."""

from __future__ import annotations

import json

import pytest

from areal_hex_plugin.costmodel import kernel_data
from areal_hex_plugin.costmodel.decode import KERNEL_DATA, ROOFLINE
from areal_hex_plugin.costmodel.lengths import length_stats
from areal_hex_plugin.costmodel.rollout import RolloutStage, decode_step_s, estimate_rollout
from tests.conftest import REPO
from tests.planner.helpers import recipe_with_pools

ORACLE = json.loads((REPO / "tests" / "costmodel" / "data" / "kernel_data_oracle.json").read_text())
MODELS = {"DeepSeek-R1-Distill-Qwen-7B": "7b", "DeepSeek-R1-Distill-Qwen-14B": "14b"}


def _recipe(gpu: str, model: str = "7b"):
    return recipe_with_pools([(gpu, 8, 1)], model)


@pytest.mark.parametrize(
    "gpu, model, tp",
    sorted({(p["gpu"], p["model"], p["tp"]) for p in ORACLE["points"]}),
)
def test_decode_step_within_10_percent_of_the_oracle(gpu, model, tp):
    """3 batch sizes x 2 contexts per covered type and layout, against aiconfigurator's own figures."""
    recipe = _recipe(gpu, MODELS[model])
    points = [p for p in ORACLE["points"] if (p["gpu"], p["model"], p["tp"]) == (gpu, model, tp)]
    assert len({p["batch"] for p in points}) == 3 and len({p["context"] for p in points}) == 2
    stages = (RolloutStage(recipe.cluster.pools[0].name, tp),)
    for p in points:
        seconds, source = decode_step_s(
            recipe.cluster, recipe.workload, recipe.calibration, stages, p["batch"], p["context"]
        )
        assert source == KERNEL_DATA
        assert seconds == pytest.approx(p["decode_ms"] / 1000, rel=0.10), p


def test_the_roofline_serves_uncovered_types_and_measured_factors():
    h800 = _recipe("H800-PCIe")
    stages = (RolloutStage(h800.cluster.pools[0].name, 1),)
    assert decode_step_s(h800.cluster, h800.workload, h800.calibration, stages, 32, 2048)[1] == ROOFLINE
    # H100 is covered, but a profile of the user's own H100s (here: a measured hbm_fraction) is closer to them.
    h100 = _recipe("H100")
    stages = (RolloutStage(h100.cluster.pools[0].name, 1),)
    generic = h100.calibration
    measured = generic.with_factors("H100", {"hbm_fraction": 0.7}, "profile h100.json")
    assert decode_step_s(h100.cluster, h100.workload, generic, stages, 32, 2048)[1] == KERNEL_DATA
    assert decode_step_s(h100.cluster, h100.workload, measured, stages, 32, 2048)[1] == ROOFLINE


def test_a_replica_estimate_says_where_its_step_came_from_and_uses_it():
    recipe = _recipe("H100")
    cal = recipe.calibration
    lengths = length_stats(recipe.workload.output_lengths, recipe.workload.rl.n_samples)
    pool = recipe.cluster.pools[0].name
    one = estimate_rollout(recipe.cluster, recipe.workload, cal, lengths, (RolloutStage(pool, 1),))
    assert one.feasible and one.decode_source == KERNEL_DATA
    ctx = recipe.workload.prompt_tokens + lengths.inflight_position
    table = kernel_data.decode_iteration_s("H100", recipe.workload.model, 1, one.concurrency, ctx)
    assert one.step_time_s == pytest.approx(table, rel=1e-9)
    # Two pipeline stages of TP1: each stage runs half the layers of a micro-batch of half the sequences, plus
    # its hand-off; two micro-batches make the cycle.
    two = estimate_rollout(
        recipe.cluster, recipe.workload, cal, lengths, (RolloutStage(pool, 1), RolloutStage(pool, 1))
    )
    assert two.decode_source == KERNEL_DATA
    half = kernel_data.decode_iteration_s("H100", recipe.workload.model, 1, two.concurrency / 2, ctx)
    assert half <= two.step_time_s <= 1.05 * half
