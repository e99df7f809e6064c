"""Re-plan when a refit changes the answer: the recipe planned again under the refit model (same objective, same
machines), the running plan scored under it, and a suggestion where the new plan is faster by more than the
threshold.

The running plan is scored with its layouts held and its shares re-solved under the refit model
(:func:`score_plan`: the planner's share rule and runtime scoring, as ``replan`` scores a fleet left after a
loss), since shares change live at no cost; a re-plan is suggested only for what that re-share cannot reach. Both
plans are scored the same way, so the gain compares like with like. What it reaches may be machines that change
role or layout (``diff``), or only the runtime settings of the running layouts (``retuned``: the update window,
the rollouts admitted at once, the servers' in-flight caps): a refit that finds the training type faster than
believed keeps every machine's role and layout, but the rollout side should keep more in flight to match.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from areal_hex_plugin.costmodel import CostModel, RolloutStage, TrainStage
from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.costmodel.refit import Measured, RunLayout
from areal_hex_plugin.costmodel.weightsync import strategy_for
from areal_hex_plugin.plan import HexPlan, PlanChange
from areal_hex_plugin.planner.inflight import best_split, held_runtime, serial_rollout_s
from areal_hex_plugin.planner.replan import MachineDiff, keep_roles, machine_diff, share_key
from areal_hex_plugin.planner.reshare import ServerShape, plan_reshare_gain, replica_config

# Gain of the new plan over the running one (both under the refit model) above which a re-plan is suggested:
# about the refit prediction's own uncertainty, chosen with `simulate --truth` (docs/elastic.md): above the
# largest gain a refit finds where the true factors plan nothing better (0.4% on the paper recipes) plus the
# runtime model's error between two runtimes of one layout in the simulator (2.1% on the 1.5B recipe, H20 -30%).
THRESHOLD = 0.03


def change_threshold(floor: float, measured: Measured) -> float:
    """The gain a refit's change (a re-share or a re-plan) must beat: ``floor`` (``hex.calibration.
    replan_threshold``), or the refit prediction's uncertainty where the window's steps scatter more
    (:attr:`Measured.uncertainty`): on noisy steps a change that gains less is the noise's."""
    return max(floor, measured.uncertainty)


def plan_layout(plan: HexPlan, transport: str) -> RunLayout:
    """The training stages and weight-update receivers of ``plan`` (replica groups on a machine split with
    training get their weights over its GPU links)."""
    beside = {a.group for m in plan.machines if m.role == "split" for a in m.gpus if a.role == "rollout"}
    replicas = tuple(
        (tuple(RolloutStage(g.pool, g.tp) for _ in range(g.pp)), g.count)
        for i, g in enumerate(plan.rollout.replicas)
        if i not in beside
    )
    return RunLayout(
        train=tuple(TrainStage(s.pool, s.dp, s.tp, s.hybrid) for s in plan.train.stages),
        replicas=replicas,
        strategy=strategy_for(transport),
        colocated=tuple(sorted({plan.rollout.replicas[g].pool for g in beside})),
    )


@dataclass(frozen=True)
class Score:
    tokens_per_s: float
    shares: tuple[float, ...]  # per replica group of the plan, summing to 1


def score_plan(cm: CostModel, plan: HexPlan, transport: str) -> Score:
    """``plan``'s tokens/s under ``cm`` with its layouts held, its shares re-solved (the planner's share rule and
    runtime scoring at the plan's window and admission)."""
    layout = plan_layout(plan, transport)
    train = cm.train(layout.train)
    groups = tuple(
        (replica_config(cm, ServerShape(g.pool, g.tp, g.pp, g.concurrency)), g.count)
        for g in plan.rollout.replicas
    )
    if not train.feasible or not groups or any(c.tokens_per_s <= 0 for c, _ in groups):
        return Score(0.0, tuple(0.0 for _ in plan.rollout.replicas))
    window = max(1, plan.solver.window_steps)
    held = held_runtime(cm, groups, window, admitted=plan.staleness.max_concurrent_rollouts)
    step = layout.sync_s(cm) / window + max(serial_rollout_s(held, train.step_time_s), train.step_time_s)
    split = best_split(
        held.groups, cm.workload.rl.samples_per_step * window, cm.workload.output_lengths.mean
    )[1]
    total = sum(split) or 1
    tokens = cm.workload.tokens_per_step / step if math.isfinite(step) and step > 0 else 0.0
    return Score(tokens, tuple(x / total for x in split))


@dataclass(frozen=True)
class Decision:
    """The running plan and the plan the refit model gives, both scored under it."""

    running: HexPlan
    plan: HexPlan  # the new plan (roles kept where it has room), with the change recorded
    diff: tuple[MachineDiff, ...]  # machines that change role or layout
    running_tokens_per_s: float  # the running layouts, shares re-solved
    tokens_per_s: float  # the new plan's
    shares: tuple[float, ...]  # the running layouts' re-solved shares
    share_gain: float  # how much faster the running servers generate with their shares re-solved
    threshold: float

    @property
    def gain(self) -> float:
        return self.tokens_per_s / self.running_tokens_per_s - 1 if self.running_tokens_per_s else math.inf

    @property
    def retuned(self) -> tuple[str, ...]:
        """The runtime settings the new plan changes on machines whose role and layout it keeps (see
        :func:`runtime_changes`)."""
        return runtime_changes(self.running, self.plan)

    @property
    def suggested(self) -> bool:
        return bool(self.diff or self.retuned) and self.gain > self.threshold

    def reshared(self, step: int | None = None) -> HexPlan:
        """The running plan with its shares re-solved under the refit model, the change recorded."""
        groups = self.running.rollout.replicas
        replicas = [replace(g, share=round(s, 6)) for g, s in zip(groups, self.shares, strict=True)]
        change = PlanChange(
            kind="reshare",
            reason="refit: shares re-solved under the refit model",
            step=step,
            tokens_per_s_before=self.running.predicted.tokens_per_s,
            tokens_per_s_after=round(self.running_tokens_per_s, 3),
            shares={share_key(i, g): g.share for i, g in enumerate(replicas)},
        )
        rollout = replace(self.running.rollout, replicas=replicas)
        return replace(self.running, rollout=rollout, changes=[*self.running.changes, change])

    def to_dict(self) -> dict:
        return {
            "suggested": self.suggested,
            "gain": self.gain,
            "share_gain": self.share_gain,
            "threshold": self.threshold,
            "tokens_per_s_before": self.running_tokens_per_s,
            "tokens_per_s_after": self.tokens_per_s,
            "shares_before": {share_key(i, g): g.share for i, g in enumerate(self.running.rollout.replicas)},
            "shares_reshared": {
                share_key(i, g): s
                for i, (g, s) in enumerate(zip(self.running.rollout.replicas, self.shares, strict=True))
            },
            "shares_after": {share_key(i, g): g.share for i, g in enumerate(self.plan.rollout.replicas)},
            "machines": [vars(d) for d in self.diff],
            "runtime": list(self.retuned),
        }


def describe_changes(diff: Sequence[MachineDiff], retuned: Sequence[str]) -> str:
    """What a suggested plan changes: the machines that change role or layout, then the runtime settings it
    retunes on the layouts it keeps (``Decision.retuned``)."""
    moves = "; ".join(f"{d.host}: {d.before or '(new)'} -> {d.after or '(gone)'}" for d in diff)
    parts = [f"{len(diff)} machines change role or layout ({moves})"] if diff else []
    return "; ".join([*parts, *retuned]) or "nothing"


def runtime_changes(running: HexPlan, new: HexPlan) -> tuple[str, ...]:
    """What ``new`` sets otherwise than ``running`` besides roles and layouts: the update window, the rollouts
    admitted at once, the in-flight cap of replica groups of the same shape (a server restarts with it)."""
    out = []
    before, after = running.solver.window_steps, new.solver.window_steps
    if before != after:
        out.append(f"update window {before} -> {after} steps")
    before, after = running.staleness.max_concurrent_rollouts, new.staleness.max_concurrent_rollouts
    if before != after:
        out.append(f"max_concurrent_rollouts {before} -> {after}")
    caps = {(g.pool, g.tp, g.pp): g.concurrency for g in running.rollout.replicas}
    for g in new.rollout.replicas:
        cap = caps.get((g.pool, g.tp, g.pp))
        if cap is not None and cap != g.concurrency:
            out.append(f"{g.pool} tp{g.tp}pp{g.pp} in-flight cap {cap} -> {g.concurrency}")
    return tuple(out)


def decide(
    recipe, running: HexPlan, calibration: Calibration, threshold: float = THRESHOLD, step: int | None = None
) -> Decision:
    """Plan ``recipe`` under ``calibration`` and score it beside ``running`` (see the module doc)."""
    from areal_hex_plugin.planner import plan_recipe

    refit = replace(recipe, calibration=calibration)
    cm = CostModel(refit.cluster, refit.workload, calibration)
    transport = recipe.hex.transport
    current = score_plan(cm, running, transport)
    new = keep_roles(running, plan_recipe(refit))
    scored = score_plan(cm, new, transport)
    retuned = runtime_changes(running, new)
    change = PlanChange(
        kind="replan",
        hosts=sorted({d.host for d in machine_diff(running, new)}),
        reason=f"refit: the refit model plans {scored.tokens_per_s:,.0f} tokens/s against the running plan's "
        f"{current.tokens_per_s:,.0f} (shares re-solved)" + (f"; {', '.join(retuned)}" if retuned else ""),
        step=step,
        tokens_per_s_before=round(current.tokens_per_s, 3),
        tokens_per_s_after=round(scored.tokens_per_s, 3),
        shares={share_key(i, g): g.share for i, g in enumerate(new.rollout.replicas)},
    )
    new = replace(new, changes=[*running.changes, change])
    return Decision(
        running, new, machine_diff(running, new), current.tokens_per_s, scored.tokens_per_s, current.shares,
        plan_reshare_gain(cm, running), threshold,
    )  # fmt: skip
