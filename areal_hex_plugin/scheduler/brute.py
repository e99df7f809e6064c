"""Brute force over the plan space of a small cluster, for checking the search: it shares none of its pruning.

Every machine split (train, rollout, idle per pool, within the budget) x every training layout x every rollout
fleet, each scored with the cost model alone:
- training: the pools of the split in every order, each a block of k identical (dp, tp) stages, every k within
  hex.solver.max_pp_stages, every TP degree inside a machine and every dp that fits (the search fixes the order,
  takes the largest dp and cuts TP degrees); layouts whose pools send the same weight bytes have the same weight
  sync, so only the fastest of them is kept (exact);
- rollout: per pool, any one replica shape (tp, pp), as many replicas as its rollout machines hold (the search
  solves a knapsack per rebuild-time bound and may mix shapes; fewer replicas are the split with fewer machines);
- samples split by largest remainder in proportion to replica speed, over the same delta window.
Its cost grows as the product of the pools' options: keep it to 2-3 pools of at most 4 machines.
"""

from __future__ import annotations

import math
from itertools import permutations, product

from areal_hex_plugin.costmodel import TrainStage
from areal_hex_plugin.scheduler.evaluate import (
    Evaluation,
    Evaluator,
    Fleet,
    occupied,
    replica_stages,
    window_rollout_s,
)
from areal_hex_plugin.scheduler.rollout_model import ReplicaConfig, largest_remainder
from areal_hex_plugin.scheduler.split import all_splits
from areal_hex_plugin.scheduler.train_search import TrainChoice, tp_degrees


def brute_force(
    ev: Evaluator, limits: tuple[int, ...], budget: float | None, window: int
) -> Evaluation | None:
    """The best plan of the space above at ``window`` (highest tokens/s, then cheapest), or None."""
    layouts: dict[tuple[int, ...], list[TrainChoice]] = {}
    fleets: dict[tuple[int, ...], list[tuple[Fleet, float]]] = {}
    best: tuple[tuple[float, float], Evaluation] | None = None
    for split in all_splits(limits):
        cost = split.cost_per_hour(ev.cluster)
        if budget is not None and cost > budget + 1e-9:
            continue
        if split.train not in layouts:
            layouts[split.train] = _layouts(ev, split.train)
        if split.rollout not in fleets:
            fleets[split.rollout] = _fleets(ev, split.rollout, window)
        for train in layouts[split.train]:
            senders = ev.cm.senders(train.stages)  # each stage sends its layers from its pool
            for fleet, rollout_s in fleets[split.rollout]:
                replicas = [(replica_stages(c), y) for c, y in fleet.groups]
                sync_s = ev.cm.weight_sync(senders, replicas, strategy=ev.sync_strategy).seconds
                step = sync_s + max(rollout_s, train.step_time_s)
                key = (round(ev.tokens_per_step / step, 6), -round(cost, 6))
                if best is None or key > best[0]:
                    samples = ev.workload.rl.samples_per_step
                    shares = largest_remainder(samples, [c.tokens_per_s * y for c, y in fleet.groups])
                    e = Evaluation(
                        split=occupied(ev.cluster, train, fleet),
                        window=window,
                        cost_per_hour=cost,
                        train=train,
                        fleet=fleet,
                        train_s=train.step_time_s,
                        rollout_s=rollout_s,
                        sync_s=sync_s,
                        reward_s=ev.cm.reward_s(samples),
                        shares=tuple(shares),
                    )
                    best = (key, e)
    return best[1] if best else None


def _layouts(ev: Evaluator, counts: tuple[int, ...]) -> list[TrainChoice]:
    """The fastest feasible layout for each vector of weight bytes its pools send."""
    pools = [p for p, n in zip(ev.cluster.pools, counts, strict=True) if n]
    gpus = {p.name: n * p.gpus_per_machine for p, n in zip(ev.cluster.pools, counts, strict=True) if n}
    blocks = {p.name: _blocks(p, gpus[p.name], ev.solver.max_pp_stages) for p in pools}
    fastest: dict[tuple[tuple[str, int], ...], TrainChoice] = {}
    for size in range(1, len(pools) + 1):
        for order in permutations(pools, size):
            for choice in product(*(blocks[p.name] for p in order)):
                if sum(k for k, _, _ in choice) > ev.solver.max_pp_stages:
                    continue
                stages = tuple(
                    TrainStage(p.name, dp, tp)
                    for p, (k, dp, tp) in zip(order, choice, strict=True)
                    for _ in range(k)
                )
                estimate = ev.cm.train(stages)
                if not estimate.feasible:
                    continue
                used = tuple(sorted(ev.cm.senders(stages).items()))
                if used not in fastest or estimate.step_time_s < fastest[used].step_time_s:
                    fastest[used] = TrainChoice(stages, estimate)
    return list(fastest.values())


def _blocks(pool, gpus: int, max_pp: int) -> list[tuple[int, int, int]]:
    """(k stages, dp, tp) blocks of one pool within its GPUs."""
    return [
        (k, dp, tp)
        for k in range(1, max_pp + 1)
        for tp in tp_degrees(pool.gpus_per_machine)
        for dp in range(1, gpus // (k * tp) + 1)
    ]


def _fleets(ev: Evaluator, counts: tuple[int, ...], window: int) -> list[tuple[Fleet, float]]:
    """Every fleet of one replica shape per rollout pool (as many as fit), with its rollout time per step."""
    options = []
    for pool, n in zip(ev.cluster.pools, counts, strict=True):
        if not n:
            continue
        gpus = n * pool.gpus_per_machine
        choices = [(c, gpus // c.gpus) for c in _shapes(ev, pool) if c.gpus <= gpus]
        if not choices:
            return []
        options.append(choices)
    samples = ev.workload.rl.samples_per_step * window
    mean = ev.workload.output_lengths.mean
    reward = ev.cm.reward_s(ev.workload.rl.samples_per_step)
    out = []
    for groups in product(*options):
        fleet = ev._within_staleness(Fleet(tuple(groups), True))
        rollout_s = window_rollout_s(fleet, samples, mean, updates=window) / window + reward
        if math.isfinite(rollout_s):
            out.append((fleet, rollout_s))
    return out


def _shapes(ev: Evaluator, pool) -> list[ReplicaConfig]:
    """Every feasible replica shape of a pool (no dominance pruning)."""
    shapes = []
    for pp in range(1, ev.solver.max_pp_stages + 1):
        for tp in tp_degrees(pool.gpus_per_machine):
            if ev.solver.rollout_layout and [tp, pp] != ev.solver.rollout_layout:
                continue
            est = ev.cm.rollout(replica_stages(ReplicaConfig(pool.name, tp, pp, 0.0, 1)))
            if est.feasible and est.tokens_per_s > 0:
                shapes.append(
                    ReplicaConfig(pool.name, tp, pp, est.tokens_per_s, est.concurrency, est.recompute_s)
                )
    return shapes
