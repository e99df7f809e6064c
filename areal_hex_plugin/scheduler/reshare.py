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

from collections.abc import Sequence
from dataclasses import dataclass, replace

from areal_hex_plugin.costmodel import CostModel, RolloutStage
from areal_hex_plugin.scheduler.inflight import as_run, best_split
from areal_hex_plugin.scheduler.rollout_model import ReplicaConfig
from areal_hex_plugin.specs.workload import LengthDistribution, WorkloadSpec

# Samples the shares are split over: fractions to 1/1000.
RESOLUTION = 1000


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


def with_lengths(workload: WorkloadSpec, lengths: Sequence[int], source: str) -> WorkloadSpec:
    """``workload`` with the output lengths measured (each capped at ``max_new_tokens``, as the plan's are)."""
    cap = workload.rl.max_new_tokens
    measured = LengthDistribution(tuple(sorted(min(cap, max(1, int(n))) for n in lengths)), source)
    return replace(workload, output_lengths=measured)


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
    runtime (:func:`reshare`)."""
    measured = CostModel(cm.cluster, with_lengths(cm.workload, lengths, source), cm.calibration)
    basis = reshare(cm, servers, live, samples, window)
    now = reshare(measured, servers, live, samples, window)
    return Drift(now.makespan_s / basis.makespan_s - 1, measured, now.shares)
