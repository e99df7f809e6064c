"""Routing shares for the rollout servers a run has now: the planner's rollout model, without a re-plan.

When a server is lost or gained, or the served output lengths drift from the plan's, the layout stays and only
the shares move. Each live server is scored by the cost model as phase 1b scores a replica shape
(:meth:`CostModel.rollout` of its pool, TP and PP under the workload's output lengths), identical servers form one
replica group, and :func:`inflight.best_split` (the planner's own share rule) splits ``resolution`` samples over the
groups; a group's samples are spread evenly over its servers. ``resolution`` sets how fine the shares are (the
router takes fractions; the plan's integer samples per step would round a small change away). Milliseconds, no
CP-SAT: the same numbers the planner used, for the servers that are here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from areal_hex_plugin.costmodel import CostModel, RolloutStage
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.planner.inflight import as_run, best_split, replica_time
from areal_hex_plugin.planner.rollout_model import ReplicaConfig
from areal_hex_plugin.specs.workload import LengthDistribution, WorkloadSpec

# Samples the shares are split over: fractions to 1/1000.
RESOLUTION = 1000
# Bisection steps for the factor that scales the plan's lengths to a served mean (2^-40 of the range).
SCALE_STEPS = 40
# Standard errors a step's served mean must lie from the basis's before the lengths count as moved: one step's
# mean of the paper's lengths (a point mass at the cap) is known to about 7% from 500 samples, and 3 standard
# errors leave the plan's own lengths unmoved in the fault simulator's runs.
SIGNIFICANCE = 3.0


@dataclass(frozen=True)
class ServerShape:
    """One rollout server: its pool, layout and in-flight cap (what the cost model needs to score it)."""

    pool: str
    tp: int = 1
    pp: int = 1
    concurrency: int | None = None  # the plan's in-flight cap (its replica's ``concurrency``); None: none


@dataclass(frozen=True)
class Reshare:
    """Per-server shares (0 for a server not live) and the predicted seconds to generate ``resolution`` samples
    over the live servers (the makespan :func:`best_split` minimised)."""

    shares: tuple[float, ...]
    makespan_s: float


def replica_config(cm: CostModel, shape: ServerShape) -> ReplicaConfig:
    """The cost model's replica of ``shape`` (as ``Evaluator.feasible_shapes`` builds it), at its in-flight cap as
    ``InFlight.throttled`` runs it: a sample's decode, and so the wait for the longest, slows with the batch."""
    estimate = cm.rollout(
        tuple(RolloutStage(pool=shape.pool, tp=shape.tp) for _ in range(shape.pp)),
        max_sequences=shape.concurrency,
    )
    return ReplicaConfig(
        shape.pool,
        shape.tp,
        shape.pp,
        estimate.tokens_per_s,
        estimate.concurrency,
        estimate.recompute_s,
        longest_s=estimate.longest_s,
        drain_s=estimate.drain_s,
    )


def reshare(
    cm: CostModel,
    servers: Sequence[ServerShape],
    live: Sequence[bool],
    resolution: int = RESOLUTION,
    window: int = 1,
) -> Reshare:
    """Shares over the ``live`` servers by the planner's rollout model, scored as the plan's runtime scores them
    (over its update ``window``: :func:`inflight.as_run`); raises ValueError when none is live."""
    if len(live) != len(servers):
        raise ValueError(f"{len(live)} live flags for {len(servers)} servers")
    members: dict[ServerShape, list[int]] = {}
    for index, (shape, up) in enumerate(zip(servers, live, strict=True)):
        if up:
            members.setdefault(shape, []).append(index)
    if not members:
        raise ValueError("no live rollout server to share the samples")
    shapes = sorted(members, key=lambda s: (s.pool, s.tp, s.pp))
    groups = as_run(cm, tuple((replica_config(cm, s), len(members[s])) for s in shapes), window)
    makespan, samples = best_split(groups, max(resolution, len(groups)), cm.workload.output_lengths.mean)
    shares = [0.0] * len(servers)
    total = sum(samples)
    for shape, count in zip(shapes, samples, strict=True):
        for index in members[shape]:
            shares[index] = count / total / len(members[shape])
    return Reshare(tuple(shares), makespan)


def split_makespan_s(
    cm: CostModel,
    servers: Sequence[ServerShape],
    live: Sequence[bool],
    shares: Sequence[float],
    resolution: int = RESOLUTION,
    window: int = 1,
) -> float:
    """The predicted seconds the ``live`` servers take to generate ``resolution`` samples split by ``shares``
    (each server its share's samples, rounded up), scored as :func:`reshare` scores its own split."""
    configs: dict[ServerShape, ReplicaConfig] = {}
    worst = 0.0
    for shape, up, share in zip(servers, live, shares, strict=True):
        if not up or share <= 0:
            continue
        if shape not in configs:
            ((configs[shape], _),) = as_run(cm, ((replica_config(cm, shape), 1),), window)
        samples = math.ceil(share * resolution - 1e-9)
        worst = max(worst, replica_time(configs[shape], samples, cm.workload.output_lengths.mean, 1))
    return worst if worst > 0 else math.inf


def reshare_gain(
    cm: CostModel,
    servers: Sequence[ServerShape],
    live: Sequence[bool],
    held: Sequence[float],
    solved: Reshare,
    window: int = 1,
) -> float:
    """How much faster the ``solved`` shares generate than the ``held`` ones under ``cm`` (0.1: 10%)."""
    return split_makespan_s(cm, servers, live, held, window=window) / solved.makespan_s - 1


def plan_reshare_gain(cm: CostModel, plan: HexPlan) -> float:
    """How much faster ``plan``'s servers generate under ``cm`` with their shares re-solved (as a live re-share
    solves them) than with its own."""
    groups = plan.rollout.replicas
    servers = [ServerShape(g.pool, g.tp, g.pp, g.concurrency) for g in groups for _ in range(g.count)]
    held = [g.share / g.count for g in groups for _ in range(g.count)]
    live = [True] * len(servers)
    window = plan.solver.window_steps
    return reshare_gain(cm, servers, live, held, reshare(cm, servers, live, window=window), window)


def with_lengths(workload: WorkloadSpec, lengths: Sequence[int], source: str) -> WorkloadSpec:
    """``workload`` with its output lengths scaled by one factor to the served ``lengths``' mean (each length,
    served or scaled, capped at ``max_new_tokens`` as the plan's are). A step serves about a thousand samples,
    few of them at the cap: their mean is known to a few percent, the tail that sets the in-flight context and the
    caps is not (rebuilt from one step's samples, the drift of the plan's own lengths read -27% to +22% in the
    fault simulator)."""
    served = _served(workload, lengths)
    scaled = _scaled_to_mean(workload.output_lengths, statistics.fmean(served), workload.rl.max_new_tokens)
    return replace(workload, output_lengths=replace(scaled, source=source))


def _served(workload: WorkloadSpec, lengths: Sequence[int]) -> list[int]:
    """The served ``lengths``, each within 1 and ``max_new_tokens`` as the plan's are."""
    cap = workload.rl.max_new_tokens
    return [min(cap, max(1, int(n))) for n in lengths]


def _scaled_to_mean(dist: LengthDistribution, mean: float, cap: int) -> LengthDistribution:
    """``dist`` with every length times one factor (rounded, within 1 and ``cap``) whose mean comes closest to
    ``mean``; ``dist`` itself where none comes closer (a basis that was scaled so already stays put)."""

    def at(factor: float) -> LengthDistribution:
        return LengthDistribution(
            tuple(min(cap, max(1, round(n * factor))) for n in dist.lengths), dist.source
        )

    low, high = 0.0, 2.0 * cap / max(1, dist.lengths[0])  # every length at 1, at the cap
    for _ in range(SCALE_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if at(middle).mean < mean else (low, middle)
    best = min((at(low), at(high)), key=lambda d: abs(d.mean - mean))
    return dist if abs(dist.mean - mean) <= abs(best.mean - mean) else best


@dataclass(frozen=True)
class Drift:
    """Served lengths against the basis: ``change`` is the predicted rollout time at the served lengths over the
    time at the basis's, less 1; ``measured`` the cost model at the served lengths and ``shares`` its shares."""

    change: float
    measured: CostModel
    shares: tuple[float, ...]


def drift(
    cm: CostModel,
    servers: Sequence[ServerShape],
    live: Sequence[bool],
    lengths: Sequence[int],
    source: str,
    samples: int = RESOLUTION,
    window: int = 1,
) -> Drift:
    """How far the served ``lengths`` move the predicted rollout time of ``samples`` samples (a window's: below,
    the wait for the longest sample hides the change) on the ``live`` servers from ``cm``'s, under the plan's
    runtime (:func:`reshare`); none where their mean is within SIGNIFICANCE standard errors of ``cm``'s (the
    error of a mean of as many of ``cm``'s lengths: a step that drew none at the cap looks steadier than it is)."""
    basis = reshare(cm, servers, live, samples, window)
    basis_lengths = cm.workload.output_lengths
    error = math.sqrt((basis_lengths.mean_square - basis_lengths.mean**2) / len(lengths))
    if abs(statistics.fmean(_served(cm.workload, lengths)) - basis_lengths.mean) <= SIGNIFICANCE * error:
        return Drift(0.0, cm, basis.shares)
    measured = CostModel(cm.cluster, with_lengths(cm.workload, lengths, source), cm.calibration)
    now = reshare(measured, servers, live, samples, window)
    return Drift(now.makespan_s / basis.makespan_s - 1, measured, now.shares)
