"""What a ranking hangs on: how a plan's numbers move with each calibrated factor and with the workload.

An input is one per-GPU-type factor of the calibration (every number of the type's efficiency dataclass,
``costmodel/calibration.py``, so new factors join by themselves) or one figure of the output-length distribution:
``mean_tokens`` (the mean length), ``sigma`` (the standard deviation of ln(length) of the samples below the cap)
and ``cap_share`` (the share of samples at the cap, ``gconfig.max_new_tokens``; only where some are). The body
(samples below the cap) and the cap mass change apart: the mean by scaling the body, sigma by spreading the body's
log-lengths about their mean at the same body mean, the cap share by weighting the cap mass against the body.

A held plan (:class:`Held`) keeps what the planner decided (training stages, replica shapes and counts, their
in-flight caps, the update window) and is re-scored on a cost model of the changed inputs as the evaluator scores
it (``planner/evaluate.py``): the window's samples split over the replicas by :func:`best_split`, the step
weight sync / window + max(rollout incl. reward, train), stretched by the expected losses of preemptible pools
(``planner/preemption.py``). Nothing is re-solved. The elasticity of a number q to
an input x is d ln q / d ln x by central differences at x (1 +- STEP), the change x actually got in the
denominator (lengths are whole tokens); None where x is 0 or did not move, or q is 0.

The flip check (:func:`flips`) re-scores every plan the planner's searches scored, each held, at x (1 +-
FLIP_CHANGE) and lets the objective pick again; a pick with other GPUs (or the same GPUs in other roles) is a
flip. It does not re-run the
searches (a re-solve per input would multiply the plan time by twice the inputs), so a flip to a split the
searches never scored goes unseen.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace

from areal_hex_plugin.costmodel import Calibration, CostModel, TrainStage
from areal_hex_plugin.costmodel.weightsync import strategy_for
from areal_hex_plugin.plan import Elasticity, Flip, HexPlan
from areal_hex_plugin.planner.inflight import held_rollout_s, replica_stages
from areal_hex_plugin.planner.preemption import Preemption, preemption_of
from areal_hex_plugin.planner.rollout_model import ReplicaConfig
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.workload import LengthDistribution, WorkloadSpec

STEP = 0.05
FLIP_CHANGE = 0.2
WORKLOAD = "workload"  # the group of the length distribution's inputs
# The cap share changes by re-weighting: the body repeated ``a`` times beside the cap samples repeated about
# ``a * (1 + change)`` times, ``a`` large enough that the cap samples change by at least this many.
CAP_SAMPLES_MOVED = 2


@dataclass(frozen=True)
class Input:
    group: str  # a GPU type, or WORKLOAD
    name: str
    value: float


@dataclass(frozen=True)
class Rules:
    """How a held plan is scored besides its cost model: the weight-sync strategy, the preemptible pools."""

    strategy: str
    preemption: Preemption | None = None

    @staticmethod
    def of(recipe) -> Rules:
        return Rules(strategy_for(recipe.hex.transport), preemption_of(recipe))


@dataclass(frozen=True)
class Held:
    """A plan held fixed: its training stages, replica groups (each shape at its in-flight cap), window and the
    rollouts upstream admits at once (``max_concurrent_rollouts``, which the driver writes: whether the window's
    steps overlap their longest samples does not move with the workload)."""

    train: tuple[TrainStage, ...]
    groups: tuple[tuple[ReplicaConfig, int], ...]
    window: int
    admitted: int

    @staticmethod
    def of_evaluation(e, cm: CostModel) -> Held:
        """A scored split (``planner/evaluate.py`` Evaluation) on its cost model."""
        admitted = cm.prompts_to_fill(sum(c.concurrency * y for c, y in e.fleet.groups))
        return Held(tuple(e.train.stages), e.fleet.groups, e.window, admitted)

    @staticmethod
    def of_plan(plan: HexPlan) -> Held:
        beside = {a.group for m in plan.machines if m.role == "split" for a in m.gpus if a.role == "rollout"}
        groups = tuple(
            (ReplicaConfig(g.pool, g.tp, g.pp, g.tokens_per_s, g.concurrency, colocated=i in beside), g.count)
            for i, g in enumerate(plan.rollout.replicas)
        )
        train = tuple(TrainStage(s.pool, s.dp, s.tp, s.hybrid) for s in plan.train.stages)
        return Held(train, groups, plan.solver.window_steps, plan.staleness.max_concurrent_rollouts)

    def tokens_per_s(self, cm: CostModel, rules: Rules) -> float:
        """The paper's metric on ``cm``, as the evaluator scores a split (0 where a layout no longer runs), with
        the expected losses of preemptible machines where there are some."""
        train = cm.train(self.train)
        estimates = [cm.rollout(replica_stages(c), max_sequences=c.concurrency) for c, _ in self.groups]
        if not train.feasible or not estimates or not all(e.feasible for e in estimates):
            return 0.0
        groups = tuple(
            (
                replace(
                    c,
                    tokens_per_s=e.tokens_per_s,
                    concurrency=e.concurrency,
                    recompute_s=e.recompute_s,
                    longest_s=e.longest_s,
                    drain_s=e.drain_s,
                ),
                y,
            )
            for (c, y), e in zip(self.groups, estimates, strict=True)
        )
        rollout = held_rollout_s(cm, groups, self.window, self.admitted, train.step_time_s)
        replicas = [(replica_stages(c), y) for c, y in groups if not c.colocated]
        colocated = tuple(sorted({c.pool for c, _ in groups if c.colocated}))
        sync = (
            cm.weight_sync(cm.senders(self.train), replicas, rules.strategy, colocated).seconds / self.window
        )
        if rules.preemption is None:
            step = sync + max(rollout, train.step_time_s)
        else:
            preemption = replace(rules.preemption, lengths=cm.workload.output_lengths)
            step = preemption.loss(train.gpus, groups).step_s(sync, rollout, train.step_time_s)
        return cm.workload.tokens_per_step / step


def inputs(gpu_types: Iterable[str], workload: WorkloadSpec, calibration: Calibration) -> list[Input]:
    """Every factor of each GPU type, then the length distribution's figures (``cap_share`` where some
    samples are at the cap and some below)."""
    out = []
    for gpu_type in gpu_types:
        eff = calibration.for_gpu(gpu_type)
        for f in fields(eff):
            value = getattr(eff, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out.append(Input(gpu_type, f.name, float(value)))
    lengths, cap = workload.output_lengths, workload.rl.max_new_tokens
    body = [n for n in lengths.lengths if n < cap]
    out.append(Input(WORKLOAD, "mean_tokens", lengths.mean))
    if body:
        out.append(Input(WORKLOAD, "sigma", _sigma(body)))
        if len(body) < len(lengths.lengths):
            out.append(Input(WORKLOAD, "cap_share", 1 - len(body) / len(lengths.lengths)))
    return out


def _sigma(body: list[int]) -> float:
    logs = [math.log(n) for n in body]
    mean = sum(logs) / len(logs)
    return math.sqrt(sum((v - mean) ** 2 for v in logs) / len(logs))


def changed(
    inp: Input, change: float, workload: WorkloadSpec, calibration: Calibration
) -> tuple[WorkloadSpec, Calibration, float] | None:
    """The workload and calibration with ``inp`` moved by the relative ``change``, and the value it got (None: a
    cap share that would reach 1)."""
    if inp.group != WORKLOAD:
        value = inp.value * (1 + change)
        return workload, calibration.with_factors(inp.group, {inp.name: value}), value
    cap = workload.rl.max_new_tokens
    lengths = sorted(workload.output_lengths.lengths)
    body, at_cap = [n for n in lengths if n < cap], [n for n in lengths if n >= cap]
    if inp.name == "mean_tokens":
        body = [min(cap - 1, max(1, round(n * (1 + change)))) for n in body]
    elif inp.name == "sigma":
        logs = [math.log(n) for n in body]
        centre = sum(logs) / len(logs)
        spread = [math.exp(centre + (v - centre) * (1 + change)) for v in logs]
        scale = sum(body) / sum(spread)
        body = [min(cap - 1, max(1, round(n * scale))) for n in spread]
    else:  # cap_share: the body repeated `a` times, the cap samples about a * (1 + change) times
        share = inp.value * (1 + change)
        if share >= 1:
            return None
        a = math.ceil(CAP_SAMPLES_MOVED / (len(at_cap) * abs(change)))
        cap_count = round(share * a * len(body) / (1 - share))
        body, at_cap = body * a, at_cap[:1] * cap_count
    dist = LengthDistribution(
        tuple(sorted(body + at_cap)), f"{workload.output_lengths.source}, {inp.name} changed"
    )
    if inp.name == "mean_tokens":
        value = dist.mean
    elif inp.name == "sigma":
        value = _sigma(body)
    else:
        value = len(at_cap) / len(dist.lengths)
    return replace(workload, output_lengths=dist), calibration, value


def model(base: CostModel, workload: WorkloadSpec, calibration: Calibration) -> CostModel:
    """A cost model of ``base``'s cluster on a changed workload or calibration (``base``'s length statistics
    where the workload is its own)."""
    if workload is base.workload:
        return base.with_calibration(calibration)
    return CostModel(base.cluster, workload, calibration)


Measure = Callable[[WorkloadSpec, Calibration], dict[str, float]]


def elasticities(
    all_inputs: list[Input],
    measure: Measure,
    workload: WorkloadSpec,
    calibration: Calibration,
    step: float = STEP,
) -> dict[Input, dict[str, float | None]]:
    """Per input, d ln q / d ln x of each number q that ``measure`` gives on a changed workload and calibration."""
    out = {}
    for inp in all_inputs:
        up_in, down_in = changed(inp, step, workload, calibration), changed(inp, -step, workload, calibration)
        if inp.value <= 0 or up_in is None or down_in is None:
            out[inp] = None
            continue
        (up_w, up_c, up_x), (down_w, down_c, down_x) = up_in, down_in
        up, down = measure(up_w, up_c), measure(down_w, down_c)
        dx = math.log(up_x / down_x) if up_x > 0 and down_x > 0 else 0.0
        out[inp] = {
            key: (math.log(up[key] / down[key]) / dx if dx and up[key] > 0 and down[key] > 0 else None)
            for key in up
        }
    return out


def plan_elasticities(
    base: CostModel, rules: Rules, chosen: Held, baselines: list[Held]
) -> dict[str, dict[str, Elasticity]]:
    """Per group (GPU type, or WORKLOAD) and input: the elasticity of the chosen plan's tokens/s and of its ratio
    to the best of the ``baselines`` (each held), on ``base``'s cluster, workload and calibration."""
    cluster, workload, calibration = base.cluster, base.workload, base.calibration

    def measure(w: WorkloadSpec, c: Calibration) -> dict[str, float]:
        cm = model(base, w, c)
        rate = chosen.tokens_per_s(cm, rules)
        best = max((b.tokens_per_s(cm, rules) for b in baselines), default=0.0)
        return {"tokens_per_s": rate, "vs_best_baseline": rate / best if best > 0 else 0.0}

    found = elasticities(inputs(cluster.gpu_types, workload, calibration), measure, workload, calibration)
    out: dict[str, dict[str, Elasticity]] = {}
    for inp, e in found.items():
        e = e or {}
        out.setdefault(inp.group, {})[inp.name] = Elasticity(
            value=inp.value,
            tokens_per_s=_rounded(e.get("tokens_per_s")),
            vs_best_baseline=_rounded(e.get("vs_best_baseline")) if baselines else None,
        )
    return out


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def flips(
    base: CostModel,
    rules: Rules,
    candidates: list,
    pick: Callable[[Callable[[object], float]], object],
    chosen,
    change: float = FLIP_CHANGE,
    moves: Iterable[tuple[Input, float]] | None = None,
) -> list[Flip]:
    """Per move (an input and its relative change; default: each input at -+ ``change``), the plan ``pick`` (the
    objective's pick among ``candidates``, scored splits, by a rate) takes when each candidate is re-scored held,
    where it differs from ``chosen`` in the GPUs of each type training or generating, or in $/h."""
    cluster, workload, calibration = base.cluster, base.workload, base.calibration
    held = {e.split: Held.of_evaluation(e, base) for e in candidates}
    mine = _roles(cluster, chosen)
    if moves is None:
        moves = (
            (inp, sign * change)
            for inp in inputs(cluster.gpu_types, workload, calibration)
            if inp.value > 0
            for sign in (-1, 1)
        )
    out = []
    for inp, move in moves:
        moved = changed(inp, move, workload, calibration)
        if moved is None:
            continue
        w, c, value = moved
        cm = model(base, w, c)
        rates = {key: h.tokens_per_s(cm, rules) for key, h in held.items()}
        picked = pick(lambda e, rates=rates: rates[e.split])
        if picked is None or (_roles(cluster, picked), picked.cost_per_hour) == (mine, chosen.cost_per_hour):
            continue
        train, rollout = _roles(cluster, picked)
        out.append(
            Flip(
                group=inp.group,
                input=inp.name,
                change=round(move, 6),
                value=value,
                train=train,
                rollout=rollout,
                cost_per_hour=round(picked.cost_per_hour, 4),
                tokens_per_s=round(rates[picked.split], 3),
                chosen_tokens_per_s=round(rates[chosen.split], 3),
            )
        )
    return out


def _roles(cluster: Cluster, e) -> tuple[dict[str, int], dict[str, int]]:
    """GPU type -> GPUs training, and generating, in a scored split."""

    def by_type(parts: Iterable[tuple[str, int]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for pool, n in parts:
            gpu_type = cluster.pool(pool).gpu_type
            out[gpu_type] = out.get(gpu_type, 0) + n
        return out

    train = by_type((s.pool, s.n_gpus) for s in e.train.stages)
    return train, by_type((r.pool, r.gpus * y) for r, y in e.fleet.groups)


def describe_flip(flip: Flip, chosen_cost: float) -> str:
    """A flip as a plan warning."""
    what = f"{flip.group} {flip.input}" if flip.group != WORKLOAD else f"the workload's {flip.input}"
    train, rollout = (
        " + ".join(f"{n} {t}" for t, n in sorted(g.items())) for g in (flip.train, flip.rollout)
    )
    return (
        f"the plan hangs on {what}: at {100 * flip.change:+.0f}% ({flip.value:.4g}) the planner would pick "
        f"{train} training and {rollout} generating (${flip.cost_per_hour:,.2f}/h, {flip.tokens_per_s:,.0f} "
        "tokens/s) over this plan "
        f"(${chosen_cost:,.2f}/h, {flip.chosen_tokens_per_s:,.0f} tokens/s there); measure it before renting"
    )
