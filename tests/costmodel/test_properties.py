"""Properties the models must keep for any shape the scheduler may ask about."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hex_plugin.costmodel import CostModel, RolloutStage, TrainStage
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.models import BUILTIN_MODELS
from tests.costmodel.helpers import recipe

PAPER = recipe("paper/7b.yaml")
QWEN25 = [BUILTIN_MODELS[f"Qwen2.5-{size}"] for size in ("0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B")]
models = st.sampled_from(QWEN25)
pools = st.sampled_from(["h20", "h800"])
FAST = settings(max_examples=40, deadline=None)


def _model(shape) -> CostModel:
    return CostModel(PAPER.cluster, replace(PAPER.workload, model=shape))


def _with_hbm(gb: float) -> Cluster:
    pools = tuple(replace(p, gpu=replace(p.gpu, hbm_gb=gb)) for p in PAPER.cluster.pools)
    return replace(PAPER.cluster, pools=pools)


def _tps(shape) -> list[int]:
    return [t for t in (1, 2, 4, 8) if shape.heads % t == 0]


@FAST
@given(models, pools, st.integers(1, 3))
def test_more_tensor_parallel_gpus_never_slow_a_replica_down_over_nvlink(shape, pool, pp):
    cm = _model(shape)
    rates = []
    for tp in _tps(shape):
        est = cm.rollout(tuple(RolloutStage(pool, tp) for _ in range(pp)))
        if est.feasible:
            rates.append(est.tokens_per_s)
    assert rates == sorted(rates)


@FAST
@given(models, pools, st.sampled_from([1, 2, 4]))
def test_more_data_parallel_gpus_in_a_machine_never_slow_training(shape, pool, tp):
    if shape.heads % tp:
        return
    cm = _model(shape)
    times = [
        est.step_time_s
        for dp in (1, 2, 4, 8)
        if dp * tp <= 8 and (est := cm.train((TrainStage(pool, dp, tp),))).feasible
    ]
    assert times == sorted(times, reverse=True)


@FAST
@given(pools, st.sampled_from([1, 2, 4]), st.sampled_from([(1, 1), (4, 1), (8, 1), (2, 2), (4, 2)]))
def test_memory_grows_with_model_size(pool, tp, layout):
    dp, ttp = layout
    weights, train_mem = [], []
    for shape in QWEN25:
        if shape.heads % tp == 0:
            r = _model(shape).rollout((RolloutStage(pool, tp),))
            weights.append(r.weights_gb_per_gpu if r.feasible else float("inf"))
        if shape.heads % ttp == 0:
            t = _model(shape).train((TrainStage(pool, dp, ttp),))
            train_mem.append(t.memory_gb_per_gpu[0] if t.memory_gb_per_gpu else float("inf"))
    assert weights == sorted(weights) and train_mem == sorted(train_mem)


@FAST
@given(models, st.floats(8, 200), st.floats(0.3, 0.99), st.sampled_from([1, 2, 4]), st.sampled_from([1, 8]))
def test_infeasible_stays_infeasible_with_less_memory(shape, hbm_gb, shrink, tp, dp):
    if shape.heads % tp:
        return
    big = CostModel(_with_hbm(hbm_gb), replace(PAPER.workload, model=shape))
    small = CostModel(_with_hbm(hbm_gb * shrink), replace(PAPER.workload, model=shape))
    roll, train = (RolloutStage("h20", tp),), (TrainStage("h20", dp, tp),)
    if not big.rollout(roll).feasible:
        assert not small.rollout(roll).feasible
    if not big.train(train).feasible:
        assert not small.train(train).feasible
    if small.rollout(roll).feasible:
        assert small.rollout(roll).concurrency <= big.rollout(roll).concurrency
