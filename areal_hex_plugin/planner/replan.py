"""A new plan after machines are lost or gained: the smallest change the objective allows.

First, a lost machine with a spare of its pool (a gained host of that pool, else a machine the plan left idle)
is replaced by the spare one for one: same role, same GPUs, same layout, nothing else moves, and the prediction
stands. For the machines lost beyond the spares, two cases:

- **Only rollout machines lost (and any gained)**: the training layout and every surviving machine stay exactly
  as they were. The replicas on a lost machine go; a gained machine serves its pool's planned replica shape (the
  fastest per GPU the cost model finds, if the plan had none there); the shares of a step's samples are
  re-solved over the replicas left by :func:`inflight.best_split`, the planner's own share rule. The predicted
  rollout seconds per step are the fleet left's, scored as the planner scores a runtime: at its in-flight caps,
  over the plan's window with its admitted rollouts (:func:`inflight.held_runtime`: a window that drains is
  charged its drain, one whose steps overlap their longest samples is not charged them).
- **A training machine lost**: the training layout must change, so the recipe is planned again on the machines
  left (plus those gained), by the same deterministic search. Machines within a pool are interchangeable to the
  cost model, so the new plan's roles are then mapped onto hosts keeping every machine's old role where the new
  plan has room for it: only the machines the new plan needs in another role move.

Deterministic: no clock, the search's own work-based limit, ties broken by host order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.plan import GpuAssignment, HexPlan, Machine, PlanChange, Predicted, ReplicaGroup
from areal_hex_plugin.planner.inflight import best_split, held_runtime, serial_rollout_s
from areal_hex_plugin.planner.reshare import ServerShape, replica_config
from areal_hex_plugin.planner.rollout_model import ReplicaConfig, largest_remainder


@dataclass(frozen=True)
class MachineDiff:
    host: str
    pool: str
    before: str  # role and layout before ("" for a gained machine)
    after: str  # and after ("" for a lost one)


@dataclass(frozen=True)
class Replan:
    plan: HexPlan
    diff: tuple[MachineDiff, ...]  # only the machines that changed role or layout, lost or gained
    structural: bool  # the training layout changed (a full re-plan)

    @property
    def before_tokens_per_s(self) -> float:
        return self.plan.changes[-1].tokens_per_s_before

    @property
    def after_tokens_per_s(self) -> float:
        return self.plan.predicted.tokens_per_s


def share_key(index: int, group) -> str:
    """A replica group's key in :attr:`PlanChange.shares`."""
    return f"{group.pool}/tp{group.tp}pp{group.pp}#{index}"


def replan(recipe, old: HexPlan, lost: Sequence[str], gained: dict[str, list[str]]) -> Replan:
    """The plan for ``old``'s machines less ``lost`` plus ``gained`` (pool -> new hosts); see the module doc."""
    hosts = {m.host: m for m in old.machines}
    _check_hosts(recipe, hosts, lost, gained)
    lost_set = set(lost)
    plan, rename, spare_gained = _substitute(old, lost_set, gained)
    left = {h for h in lost_set if h not in rename and hosts[h].role != "idle"}
    structural = any(hosts[h].role == "train" for h in left)
    if structural:
        plan = _replan_all(recipe, plan, left, spare_gained)
    elif left or spare_gained:
        plan = _reshare_rollout(recipe, plan, left, spare_gained)
    change = PlanChange(
        kind="replan",
        hosts=sorted(lost_set) + sorted(h for hs in gained.values() for h in hs),
        reason=_reason(lost_set, gained, rename, structural, bool(left or spare_gained)),
        tokens_per_s_before=old.predicted.tokens_per_s,
        tokens_per_s_after=plan.predicted.tokens_per_s,
        shares={share_key(i, g): g.share for i, g in enumerate(plan.rollout.replicas)},
    )
    plan = replace(plan, changes=[*old.changes, change])
    return Replan(plan, machine_diff(old, plan), structural)


def _reason(
    lost: set[str], gained: dict[str, list[str]], rename: dict[str, str], structural: bool, rest: bool
) -> str:
    parts = []
    if lost:
        parts.append(f"lost {', '.join(sorted(lost))}")
    for pool, hs in sorted(gained.items()):
        parts.append(f"gained {', '.join(hs)} in {pool}")
    what = [f"{new} replaces {host}" for host, new in sorted(rename.items())]
    if structural:
        what.append("training layout re-planned")
    elif rest:
        what.append("rollout shares re-solved, training unchanged")
    return f"{'; '.join(parts)}: {', '.join(what)}"


def _check_hosts(
    recipe, hosts: dict[str, Machine], lost: Sequence[str], gained: dict[str, list[str]]
) -> None:
    for host in lost:
        if host not in hosts:
            raise HexError(
                "--lost",
                f"{host!r} is not a machine of the plan",
                f"name hosts of the plan: {', '.join(hosts)}",
            )
    pools = {p.name for p in recipe.cluster.pools}
    for pool, new_hosts in gained.items():
        if pool not in pools:
            raise HexError(
                "--gained", f"pool {pool!r} is not in the recipe", f"use one of {', '.join(pools)}"
            )
        for host in new_hosts:
            if host in hosts and host not in lost:
                raise HexError("--gained", f"{host!r} is already a machine of the plan", "name a new host")


def _substitute(
    old: HexPlan, lost: set[str], gained: dict[str, list[str]]
) -> tuple[HexPlan, dict[str, str], dict[str, list[str]]]:
    """``old`` with each lost working machine replaced by a spare of its pool (gained hosts first, then idle
    machines, in host order), lost idle machines dropped; lost host -> its spare, and the gained hosts left."""
    spare_gained = {pool: list(hs) for pool, hs in gained.items()}
    idle = {}
    for m in sorted(old.machines, key=lambda m: m.host):
        if m.role == "idle" and m.host not in lost:
            idle.setdefault(m.pool, []).append(m.host)
    rename: dict[str, str] = {}
    for m in sorted((m for m in old.machines if m.host in lost), key=lambda m: m.host):
        if m.role == "idle":
            continue
        pool_gained, pool_idle = spare_gained.get(m.pool, []), idle.get(m.pool, [])
        if pool_gained:
            rename[m.host] = pool_gained.pop(0)
        elif pool_idle:
            rename[m.host] = pool_idle.pop(0)
    used = set(rename.values())
    machines = [
        replace(m, host=rename[m.host]) if m.host in rename else m
        for m in old.machines
        if m.host not in used and (m.host not in lost or m.host in rename)
    ]
    train = replace(
        old.train, stages=[replace(s, hosts=[rename.get(h, h) for h in s.hosts]) for s in old.train.stages]
    )
    plan = replace(old, machines=sorted(machines, key=lambda m: (m.pool, m.host)), train=train)
    return plan, rename, {pool: hs for pool, hs in spare_gained.items() if hs}


# -- rollout machines only ---------------------------------------------------------------------------------


def _reshare_rollout(recipe, old: HexPlan, lost: set[str], gained: dict[str, list[str]]) -> HexPlan:
    from areal_hex_plugin.costmodel import CostModel

    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    machines = [m for m in old.machines if m.host not in lost]
    # Replicas with a GPU on a lost machine are gone; the rest keep their machines and GPUs.
    dead = {
        (g.group, g.instance) for m in old.machines if m.host in lost for g in m.gpus if g.role == "rollout"
    }
    alive: dict[int, list[int]] = {}
    for m in machines:
        for g in m.gpus:
            if g.role == "rollout" and (g.group, g.instance) not in dead:
                alive.setdefault(g.group, [])
                if g.instance not in alive[g.group]:
                    alive[g.group].append(g.instance)
    groups = [(i, grp) for i, grp in enumerate(old.rollout.replicas) if alive.get(i)]
    renumber = {old_index: new_index for new_index, (old_index, _) in enumerate(groups)}
    instance_of = {(i, inst): k for i, insts in alive.items() for k, inst in enumerate(sorted(insts))}
    rebuilt = [
        replace(
            m,
            gpus=[
                g
                if g.role != "rollout"
                else replace(g, group=renumber[g.group], instance=instance_of[(g.group, g.instance)])
                for g in m.gpus
            ],
        )
        for m in machines
    ]
    new_groups = [replace(grp, count=len(alive[i])) for i, grp in groups]
    for pool_name, new_hosts in sorted(gained.items()):
        pool = recipe.cluster.pool(pool_name)
        shape = gained_shape(cm, old, pool)
        index = next(
            (k for k, g in enumerate(new_groups) if (g.pool, g.tp, g.pp) == (pool.name, shape.tp, shape.pp)),
            None,
        )
        if index is None:
            new_groups.append(
                ReplicaGroup(
                    pool=pool.name,
                    gpu_type=pool.gpu_type,
                    tp=shape.tp,
                    pp=shape.pp,
                    count=0,
                    share=0.0,
                    samples_per_step=0,
                    tokens_per_s=round(shape.tokens_per_s, 3),
                    concurrency=shape.concurrency,
                )
            )
            index = len(new_groups) - 1
        per_machine = pool.gpus_per_machine // shape.gpus
        for host in new_hosts:
            gpus = []
            for k in range(per_machine):
                instance = new_groups[index].count + k
                gpus += [
                    GpuAssignment(
                        gpu=k * shape.tp + r,
                        role="rollout",
                        stage=0,
                        tp_rank=r,
                        group=index,
                        instance=instance,
                    )
                    for r in range(shape.tp)
                ]
            new_groups[index] = replace(new_groups[index], count=new_groups[index].count + per_machine)
            rebuilt.append(
                Machine(pool=pool.name, host=host, gpu_type=pool.gpu_type, role="rollout", gpus=gpus)
            )
    if not new_groups:
        raise HexError(
            "--lost",
            "leaves no rollout machine",
            "add machines with --gained POOL=HOSTS, or plan the recipe again: areal-hex plan RECIPE --json PLAN",
        )
    window = max(1, old.solver.window_steps)
    samples = recipe.workload.rl.samples_per_step
    mean = recipe.workload.output_lengths.mean
    configs = [_config(cm, g) for g in new_groups]
    after = tuple(zip(configs, [g.count for g in new_groups], strict=True))
    held = held_runtime(cm, after, window, admitted=old.staleness.max_concurrent_rollouts)
    split = best_split(held.groups, samples * window, mean)[1]
    if not math.isfinite(held.rollout_s):
        raise HexError("--lost", "leaves fewer replicas than samples per step", "add machines with --gained")
    per_step = largest_remainder(samples, list(split))
    total = sum(split)
    new_groups = [
        replace(g, share=round(x / total, 6), samples_per_step=s)
        for g, x, s in zip(new_groups, split, per_step, strict=True)
    ]
    gpus: dict[str, int] = {}
    for g in new_groups:
        gpus[g.gpu_type] = gpus.get(g.gpu_type, 0) + g.count * g.tp * g.pp
    predicted = _rescaled(recipe, old, serial_rollout_s(held, old.predicted.train_time_s), rebuilt)
    return replace(
        old,
        predicted=predicted,
        rollout=replace(old.rollout, gpus=gpus, replicas=new_groups),
        machines=sorted(rebuilt, key=lambda m: (m.pool, m.host)),
    )


def _config(cm, group: ReplicaGroup) -> ReplicaConfig:
    """The cost model's replica of ``group`` at its in-flight cap, as the plan runs it."""
    return replica_config(cm, ServerShape(group.pool, group.tp, group.pp, group.concurrency))


def gained_shape(cm, old: HexPlan, pool) -> ReplicaConfig:
    """The replica shape a gained machine of ``pool`` serves: the plan's fastest per GPU among its one-stage
    groups in that pool, else the cost model's fastest per GPU among one-machine TP layouts."""
    planned = [
        g for g in old.rollout.replicas if g.pool == pool.name and g.pp == 1 and g.tp <= pool.gpus_per_machine
    ]
    if planned:
        best = max(planned, key=lambda g: (g.tokens_per_s / (g.tp * g.pp), -g.tp * g.pp))
        return _config(cm, best)
    from areal_hex_plugin.planner.train_search import tp_degrees

    shapes = [replica_config(cm, ServerShape(pool.name, tp)) for tp in tp_degrees(pool.gpus_per_machine)]
    shapes = [s for s in shapes if s.tokens_per_s > 0]
    if not shapes:
        raise HexError(
            "--gained", f"no rollout layout runs on pool {pool.name!r}", "gain machines of another pool"
        )
    return max(shapes, key=lambda s: (s.tokens_per_s / s.gpus, -s.gpus))


def _rescaled(recipe, old: HexPlan, rollout: float, machines: list[Machine]) -> Predicted:
    """``old``'s prediction with the rollout seconds per step ``rollout`` and the machines' price."""
    p = old.predicted
    step = p.step_time_s - max(p.rollout_time_s, p.train_time_s) + max(rollout, p.train_time_s)
    tokens = p.tokens_per_s * p.step_time_s / step if step > 0 else 0.0
    price = {pool.name: pool.price_per_gpu_hour for pool in recipe.cluster.pools}
    cost = sum(price[m.pool] * sum(g.role != "idle" for g in m.gpus) for m in machines)
    free = p.loss_free_tokens_per_s  # with preemptible pools: the rate with no machine lost, scaled alike
    if free is not None:
        before = p.weight_sync_s + max(p.rollout_time_s, p.train_time_s)
        free = round(free * before / (p.weight_sync_s + max(rollout, p.train_time_s)), 3)
    scale = tokens / p.tokens_per_s if p.tokens_per_s > 0 else 0.0  # the interval keeps its relative width

    def scaled(value: float | None, by: float) -> float | None:
        return None if value is None or not by else round(value * by, 6)

    return replace(
        p,
        tokens_per_s=round(tokens, 3),
        tokens_per_s_low=scaled(p.tokens_per_s_low, scale),
        tokens_per_s_high=scaled(p.tokens_per_s_high, scale),
        step_time_s_low=scaled(p.step_time_s_low, 1 / scale if scale else 0.0),
        step_time_s_high=scaled(p.step_time_s_high, 1 / scale if scale else 0.0),
        loss_free_tokens_per_s=free,
        cost_per_hour=round(cost, 6),
        tokens_per_dollar=round(tokens * 3600 / cost, 3) if cost else 0.0,
        step_time_s=round(step, 6),
        rollout_time_s=round(rollout, 6),
    )


# -- a training machine lost -------------------------------------------------------------------------------


def _replan_all(recipe, old: HexPlan, lost: set[str], gained: dict[str, list[str]]) -> HexPlan:
    from areal_hex_plugin.planner import plan_recipe

    pools = []
    for pool in recipe.cluster.pools:
        hosts = [pool.host(k) for k in range(pool.machines) if pool.host(k) not in lost]
        hosts += gained.get(pool.name, [])
        pools.append(replace(pool, machines=len(hosts), hosts=tuple(hosts)))
    if not any(p.machines for p in pools):
        raise HexError("--lost", "leaves no machine", "add machines with --gained POOL=HOSTS")
    pools = [p for p in pools if p.machines]
    reduced = replace(recipe, cluster=replace(recipe.cluster, pools=tuple(pools)))
    plan = plan_recipe(reduced)
    return keep_roles(old, plan)


def keep_roles(old: HexPlan, new: HexPlan) -> HexPlan:
    """``new`` with its machines' roles and GPUs moved onto hosts so that as many machines as possible keep the
    role (and, for the same role, the layout) they had in ``old``; machines of a pool are interchangeable."""
    before = {m.host: m for m in old.machines}
    rename: dict[str, str] = {}
    by_pool: dict[str, list[Machine]] = {}
    for m in new.machines:
        by_pool.setdefault(m.pool, []).append(m)
    for members in by_pool.values():
        free = sorted(m.host for m in members)
        slots = sorted(members, key=lambda m: (m.role, m.host))
        # First pass: a slot keeps a host that had the same role and layout, then the same role.
        for exact in (True, False):
            for slot in slots:
                if slot.host in rename:
                    continue
                match = next(
                    (
                        h
                        for h in free
                        if h in before
                        and before[h].role == slot.role
                        and (not exact or _layout(before[h]) == _layout(slot))
                    ),
                    None,
                )
                if match is not None:
                    rename[slot.host] = match
                    free.remove(match)
        for slot in slots:  # the rest in host order
            if slot.host not in rename:
                rename[slot.host] = free.pop(0)
    machines = sorted((replace(m, host=rename[m.host]) for m in new.machines), key=lambda m: (m.pool, m.host))
    train = replace(
        new.train,
        stages=[replace(s, hosts=[rename.get(h, h) for h in s.hosts]) for s in new.train.stages],
    )
    return replace(new, machines=machines, train=train, changes=list(old.changes))


@dataclass(frozen=True)
class LengthSuggestion:
    """The plan that measured output lengths give, beside the running plan at those lengths."""

    plan: HexPlan
    diff: tuple[MachineDiff, ...]  # machines that would change role or layout
    current_tokens_per_s: float  # the running plan's prediction, re-scored at the measured lengths
    tokens_per_s: float  # the new plan's

    @property
    def gain(self) -> float:
        return self.tokens_per_s / self.current_tokens_per_s - 1 if self.current_tokens_per_s else 0.0


def replan_for_lengths(recipe, current: HexPlan, workload) -> LengthSuggestion:
    """Plan ``recipe`` with ``workload``'s (measured) output lengths, and score ``current`` at them: its rollout
    seconds per step at those lengths as the planner scores its runtime, its tokens per step by the ratio of the
    mean lengths."""
    from areal_hex_plugin.costmodel import CostModel
    from areal_hex_plugin.planner import plan_recipe

    measured = replace(recipe, workload=workload)
    new = keep_roles(current, plan_recipe(measured))
    cm = CostModel(measured.cluster, workload, measured.calibration)
    groups = tuple((_config(cm, g), g.count) for g in current.rollout.replicas)
    held = held_runtime(
        cm, groups, max(1, current.solver.window_steps), admitted=current.staleness.max_concurrent_rollouts
    )
    rollout = serial_rollout_s(held, current.predicted.train_time_s)
    rescored = _rescaled(recipe, current, rollout, current.machines)
    tokens = rescored.tokens_per_s * workload.output_lengths.mean / recipe.workload.output_lengths.mean
    return LengthSuggestion(new, machine_diff(current, new), tokens, new.predicted.tokens_per_s)


def _layout(machine: Machine) -> tuple:
    return tuple((g.gpu, g.role, g.stage, g.tp_rank) for g in machine.gpus)


def describe_role(machine: Machine | None, plan: HexPlan | None) -> str:
    """A machine's role and layout in a few words (``train stage 0 dp2 tp1``, ``rollout tp2 x1``)."""
    if machine is None or plan is None:
        return ""
    if machine.role == "train":
        stages = sorted({g.stage for g in machine.gpus if g.role == "train"})
        parts = [f"stage {s} dp{plan.train.stages[s].dp} tp{plan.train.stages[s].tp}" for s in stages]
        return "train " + ", ".join(parts)
    if machine.role == "rollout":
        groups: dict[int, set[int]] = {}
        for g in machine.gpus:
            if g.role == "rollout":
                groups.setdefault(g.group, set()).add(g.instance)
        shapes = [
            f"tp{plan.rollout.replicas[k].tp}pp{plan.rollout.replicas[k].pp} x{len(v)}"
            for k, v in sorted(groups.items())
        ]
        return "rollout " + ", ".join(shapes)
    return "idle"


def machine_diff(old: HexPlan, new: HexPlan) -> tuple[MachineDiff, ...]:
    """The machines whose role or layout differs between the plans, lost and gained ones included."""
    a = {m.host: m for m in old.machines}
    b = {m.host: m for m in new.machines}
    out = []
    for host in sorted(set(a) | set(b)):
        before, after = describe_role(a.get(host), old), describe_role(b.get(host), new)
        if before != after:
            pool = (a.get(host) or b[host]).pool
            out.append(MachineDiff(host, pool, before, after))
    return tuple(out)
