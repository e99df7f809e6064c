"""The most cost-efficient single-pool rollout replica and training layout: what ``areal-hex estimate`` shows."""

from __future__ import annotations

from areal_hex_plugin.costmodel.model import CostModel
from areal_hex_plugin.costmodel.rollout import RolloutEstimate, RolloutStage
from areal_hex_plugin.costmodel.train import TrainEstimate, TrainStage
from areal_hex_plugin.specs.cluster import Pool


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def best_rollout(
    cm: CostModel, pool: Pool, max_pp: int
) -> tuple[tuple[RolloutStage, ...] | None, RolloutEstimate | None]:
    """The replica on ``pool`` alone with the most generated tokens/s per GPU, or the first refusal if none fits."""
    best: tuple[tuple[RolloutStage, ...], RolloutEstimate] | None = None
    refusal: tuple[tuple[RolloutStage, ...], RolloutEstimate] | None = None
    for pp in range(1, max_pp + 1):
        for tp in range(1, pool.gpus_per_machine + 1):
            stages = tuple(RolloutStage(pool.name, tp) for _ in range(pp))
            est = cm.rollout(stages)
            if not est.feasible:
                refusal = refusal or (stages, est)
                continue
            if best is None or _better(est, best[1]):
                best = (stages, est)
    return best or refusal or (None, None)


def _better(new: RolloutEstimate | TrainEstimate, old: RolloutEstimate | TrainEstimate) -> bool:
    """More tokens/s per GPU by a real margin: near-ties keep the earlier (smaller) layout."""
    return new.tokens_per_s / new.n_gpus > 1.001 * old.tokens_per_s / old.n_gpus


def best_train(
    cm: CostModel, pool: Pool, max_pp: int
) -> tuple[tuple[TrainStage, ...] | None, TrainEstimate | None]:
    """The layout on ``pool`` alone (whole machines, or part of one) with the most tokens/s per GPU."""
    sizes = sorted(
        {d for d in _divisors(pool.gpus_per_machine)}
        | {pool.gpus_per_machine * m for m in range(1, pool.machines + 1)}
    )
    best: tuple[tuple[TrainStage, ...], TrainEstimate] | None = None
    refusal: tuple[tuple[TrainStage, ...], TrainEstimate] | None = None
    for n in sizes:
        for pp in (p for p in _divisors(n) if p <= max_pp):
            per_stage = n // pp
            for tp in (t for t in _divisors(per_stage) if t <= pool.gpus_per_machine):
                stages = tuple(TrainStage(pool.name, per_stage // tp, tp) for _ in range(pp))
                est = cm.train(stages)
                if not est.feasible:
                    refusal = refusal or (stages, est)
                    continue
                if best is None or _better(est, best[1]):
                    best = (stages, est)
    return best or refusal or (None, None)
