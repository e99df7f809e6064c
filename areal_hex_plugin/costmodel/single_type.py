"""The most cost-efficient single-pool rollout replica and training layout: what ``areal-hex estimate`` shows."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from areal_hex_plugin.costmodel.model import CostModel
from areal_hex_plugin.costmodel.rollout import RolloutEstimate, RolloutStage
from areal_hex_plugin.costmodel.train import TrainEstimate, TrainStage
from areal_hex_plugin.specs.cluster import Pool

# ``areal-hex estimate`` and the baseline fit (``fit_baselines``) look at pipelines of at most this many stages
# (the depth the shipped profile was fitted at; the planner's own search goes as deep as the model allows).
SINGLE_TYPE_MAX_PP = 4


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def best_rollout(
    cm: CostModel, pool: Pool, max_pp: int
) -> tuple[tuple[RolloutStage, ...] | None, RolloutEstimate | None]:
    """The replica on ``pool`` alone with the most generated tokens/s per GPU, or the first refusal if none fits."""
    layouts = (
        tuple(RolloutStage(pool.name, tp) for _ in range(pp))
        for pp in range(1, max_pp + 1)
        for tp in range(1, pool.gpus_per_machine + 1)
    )
    return _best_per_gpu(layouts, cm.rollout)


def _best_per_gpu(layouts: Iterable[tuple], estimate: Callable) -> tuple:
    """(layout, estimate) with the most tokens/s per GPU, or the first refusal when nothing fits. Only a real
    margin (0.1%) replaces the best so far, so near-ties keep the earlier (smaller) layout."""
    best = refusal = None
    for stages in layouts:
        est = estimate(stages)
        if not est.feasible:
            refusal = refusal or (stages, est)
        elif best is None or est.tokens_per_s / est.n_gpus > 1.001 * best[1].tokens_per_s / best[1].n_gpus:
            best = (stages, est)
    return best or refusal or (None, None)


def best_train(
    cm: CostModel, pool: Pool, max_pp: int
) -> tuple[tuple[TrainStage, ...] | None, TrainEstimate | None]:
    """The layout on ``pool`` alone (whole machines, or part of one) with the most tokens/s per GPU."""
    sizes = sorted(
        {d for d in _divisors(pool.gpus_per_machine)}
        | {pool.gpus_per_machine * m for m in range(1, pool.machines + 1)}
    )
    layouts = (
        tuple(TrainStage(pool.name, n // pp // tp, tp) for _ in range(pp))
        for n in sizes
        for pp in _divisors(n)
        if pp <= max_pp
        for tp in _divisors(n // pp)
        if tp <= pool.gpus_per_machine
    )
    return _best_per_gpu(layouts, cm.train)
