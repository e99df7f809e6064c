"""Where a simulation and the plan it played disagree, and why.

The plan predicts a step as weight sync + max(rollout, train), so it expects the trainer to wait
``max(0, rollout - train)`` seconds per step for its batch. The simulation measures the train, sync and wait
seconds of each step; the difference in step time is the sum of the three differences, and the largest names the
cause.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.sim.result import SimResult

TOLERANCE = 0.05  # a simulated step further than this from the planned one is reported
SHARE_SLACK = 0.05  # a replica group served this much more or less of the samples than planned is named


@dataclass(frozen=True)
class PlanGap:
    relative: float  # (simulated step - planned step) / planned step
    reason: str

    def warning(self) -> str:
        return f"warning: the simulated step is {self.relative:+.1%} off the planned one: {self.reason}"


def plan_gap(result: SimResult, plan: HexPlan) -> PlanGap | None:
    """The simulated step's departure from the plan, when it is over :data:`TOLERANCE`, with its main cause."""
    p = plan.predicted
    if p.step_time_s <= 0:
        return None
    # With preemptible machines the plan's step is an expected one; the simulation loses no machine.
    free = p.loss_free_tokens_per_s
    relative = result.step_time_s / (p.step_time_s * p.tokens_per_s / free if free else p.step_time_s) - 1
    if abs(relative) <= TOLERANCE:
        return None
    planned_wait = max(0.0, p.rollout_time_s - p.train_time_s)
    parts = {
        "train": (result.mean("train_s"), p.train_time_s),
        "sync": (result.mean("sync_s"), p.weight_sync_s),
        "wait": (result.mean("rollout_wait_s"), planned_wait),
    }
    cause = max(parts, key=lambda name: abs(parts[name][0] - parts[name][1]))
    simulated, planned = parts[cause]
    if cause == "train":
        reason = f"training takes {simulated:.1f} s per step against {planned:.1f} s planned"
    elif cause == "sync":
        reason = f"weight sync takes {simulated:.1f} s per step against {planned:.1f} s planned"
    else:
        reason = _wait_reason(result, plan, simulated, planned)
    return PlanGap(relative, reason)


def _wait_reason(result: SimResult, plan: HexPlan, waited: float, planned: float) -> str:
    """Why the trainer waits more (or less) for its batch than the plan's rollout seconds imply."""
    head = f"the trainer waits {waited:.1f} s per step for its batch against {planned:.1f} s planned"
    total = sum(result.routed.values())
    for group, served in zip(plan.rollout.replicas, result.routed.values(), strict=True):
        share = served / total if total else 0.0
        if abs(share - group.share) > SHARE_SLACK:
            return (
                f"{head}; replica group {group.pool} tp{group.tp} pp{group.pp} served {share:.0%} of the "
                f"samples against its planned {group.share:.0%} (the router balances by queue, the plan by speed)"
            )
    if result.rollout_idle_s > 0.05 * result.step_time_s:
        return (
            f"{head}; generating GPUs idle {result.rollout_idle_s:.1f} s per step, held by the staleness bound "
            f"(eta) or the admission cap, not by decoding"
        )
    if waited < planned:
        # Where admission cannot replace a batch during training (costmodel.model.tight_step_s), or the window
        # drains, the plan waits for the rollouts left; upstream's loop, which the simulation plays, overlaps
        # more of them with the next steps.
        return (
            f"{head}; the plan waits for the rollouts admission could not replace (the longest ones), which "
            f"the simulation overlaps more with the next steps"
        )
    return (
        f"{head}; the replicas decode the batch slower in the simulation, which plays each step's longest "
        f"samples and the KV recompute after each update ({result.recompute_s_per_update:.1f} s per replica) "
        f"where the plan averages them"
    )
