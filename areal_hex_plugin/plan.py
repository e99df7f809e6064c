"""HexPlan: the one contract between the scheduler, the simulator, the AReaL integration and the CLI.

A plan is plain data: which machine does what (``machines`` lists EVERY machine of the inventory, and per GPU
what it serves), the training layout, the rollout replica groups with their workload shares, the predicted step
breakdown, the baselines it was compared with and how the solver fared. It is saved as versioned JSON; loading a
file of another version, or a malformed one, raises :class:`HexError`.

Units: seconds, tokens per second, $ per hour. GPU ids are local to their machine (0 .. gpus_per_machine - 1).

Every number has its sane range in its field's metadata (checked by ``specs/typed.py`` when a file is read), and
:func:`check_plan_fits` checks a plan against the recipe it is used with (model, pools, hosts, GPU indices, layer
counts, replica and stage sizes) before simulate, the driver or the transport use it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs import typed
from areal_hex_plugin.specs.config import MAX_MACHINES, MAX_POOLS, PICKS
from areal_hex_plugin.specs.files import read_json
from areal_hex_plugin.specs.typed import between, spec

if TYPE_CHECKING:
    from areal_hex_plugin.specs.cluster import Cluster
    from areal_hex_plugin.specs.models import ModelShape

SCHEMA_VERSION = 1
ROLES = ("train", "rollout", "idle")
# A machine's role: one of ROLES, or "split" where some of its GPUs train and others generate.
MACHINE_ROLES = ("train", "rollout", "split", "idle")
OBJECTIVES = ("max_throughput", "budget", "target")

# Ranges of a plan's numbers, generous beside what a recipe allows (specs/config.py); check_plan_fits then holds
# the plan to its recipe's actual cluster and model.
_GPUS = between(0, 4096 * 72)  # GPUs of one pool at most
_TP = between(1, 72)  # a TP group or pipeline stage stays inside one machine
_LAYERS = between(1, 1_024)
_INDEX = between(0, 4096 * 72)
_RATE = between(0, 1e12, "tokens/s")
_DOLLARS = between(0, 1e9, "$/h")
_SECONDS = between(0, 1e9, "s")


@dataclass(frozen=True)
class Predicted:
    """The paper's metric: tokens per step / (weight sync + max(rollout incl. reward, train))."""

    tokens_per_s: float = spec(help="predicted tokens per second", range=_RATE)
    cost_per_hour: float = spec(help="$ per hour of the machines used", range=_DOLLARS)
    tokens_per_dollar: float = spec(help="tokens per $", range=between(0, 1e18))
    step_time_s: float = spec(help="seconds per training step", range=_SECONDS)
    train_time_s: float = spec(
        help="seconds of training per step: the forward-only log-prob passes, then the update", range=_SECONDS
    )
    rollout_time_s: float = spec(help="generation plus reward, per step", range=_SECONDS)
    weight_sync_s: float = spec(
        help="weight sync per step (one update every solver.window_steps steps, averaged)", range=_SECONDS
    )
    reward_s: float = spec(0.0, "reward per step", _SECONDS)
    train_logp_s: float | None = spec(
        None,
        "of train_time_s, the forward-only log-prob passes (upstream's timeperf/recompute_logp and ref_logp; the "
        "rest is timeperf/train_step)",
        _SECONDS,
    )
    tokens_per_s_low: float | None = spec(
        None,
        "low end of tokens_per_s's interval: the fit's residual spread and each assumed factor's range, "
        "combined (planner/interval.py)",
        _RATE,
    )
    tokens_per_s_high: float | None = spec(None, "high end of tokens_per_s's interval", _RATE)
    step_time_s_low: float | None = spec(
        None, "low end of step_time_s's interval (tokens per step / tokens_per_s_high)", _SECONDS
    )
    step_time_s_high: float | None = spec(
        None,
        "high end of step_time_s's interval (tokens per step / tokens_per_s_low; null: unbounded)",
        _SECONDS,
    )
    loss_free_tokens_per_s: float | None = spec(
        None,
        "tokens per second with no machine lost (tokens_per_s is the expected rate with the losses of "
        "preemptible pools; the same without them)",
        _RATE,
    )
    sources: dict[str, str] = spec(
        help="per phase (rollout, train, weight_sync): where its numbers came from (method; each factor "
        "fitted / measured / assumed, with its source)",
        default_factory=dict,
    )


@dataclass(frozen=True)
class TrainStage:
    """One pipeline stage: ``dp`` x ``tp`` GPUs of one type, holding ``layers`` transformer layers."""

    pool: str
    gpu_type: str
    dp: int = spec(help="data-parallel degree", range=between(1, _GPUS.high))
    tp: int = spec(help="tensor-parallel degree", range=_TP)
    layers: int = spec(help="transformer layers this stage holds", range=_LAYERS)
    hosts: list[str] = spec(help="the machines of this stage")
    hybrid: bool = spec(
        False, "FSDP hybrid sharding: state sharded within each machine, replicated across them"
    )


@dataclass(frozen=True)
class TrainPlan:
    gpus: dict[str, int] = spec(help="GPU type -> GPUs training", range=_GPUS)
    stages: list[TrainStage] = spec(help="pipeline stages", max_items=int(_LAYERS.high))
    memory_gb_per_gpu: float = spec(0.0, "training memory per GPU", between(0, 100_000, "GB"))


@dataclass(frozen=True)
class ReplicaGroup:
    """``count`` identical rollout replicas: ``pp`` stages of ``tp`` GPUs, each stage inside one machine.

    ``share`` is the fraction of a step's samples the whole group generates (x_psi / B), ``samples_per_step``
    the same as a whole number (largest-remainder rounding), ``tokens_per_s`` one replica's predicted speed and
    ``concurrency`` the requests one replica keeps in flight.
    """

    pool: str
    gpu_type: str
    tp: int = spec(help="tensor-parallel degree", range=_TP)
    pp: int = spec(help="pipeline stages", range=_LAYERS)
    count: int = spec(help="replicas in the group", range=between(1, _GPUS.high))
    share: float = spec(help="fraction of a step's samples the group generates", range=between(0, 1))
    samples_per_step: int = spec(help="samples per step the group generates", range=between(0, 1 << 20))
    tokens_per_s: float = spec(help="one replica's predicted speed", range=_RATE)
    concurrency: int = spec(help="requests one replica keeps in flight", range=between(1, 10_000_000))


@dataclass(frozen=True)
class RolloutPlan:
    gpus: dict[str, int] = spec(help="GPU type -> GPUs generating", range=_GPUS)
    replicas: list[ReplicaGroup] = spec(help="rollout replica groups", max_items=int(_GPUS.high))


@dataclass(frozen=True)
class GpuAssignment:
    """What one GPU serves: train stage ``stage`` (dp_rank, tp_rank), or rollout replica group ``group``,
    instance ``instance``, pipeline stage ``stage`` (tp_rank); or nothing (idle)."""

    gpu: int = spec(help="GPU index on its machine", range=between(0, _TP.high - 1))
    role: str = spec(help="what the GPU serves", choices=ROLES)
    stage: int | None = spec(None, "train or pipeline stage", between(0, _LAYERS.high))
    dp_rank: int | None = spec(None, "data-parallel rank", _INDEX)
    tp_rank: int | None = spec(None, "tensor-parallel rank", between(0, _TP.high - 1))
    group: int | None = spec(None, "rollout replica group", _INDEX)
    instance: int | None = spec(None, "replica of the group", _INDEX)


@dataclass(frozen=True)
class Machine:
    pool: str
    host: str
    gpu_type: str
    role: str = spec(
        help="train | rollout | split (some GPUs train, the others generate) | idle", choices=MACHINE_ROLES
    )
    gpus: list[GpuAssignment] = spec(help="what each GPU serves", max_items=int(_TP.high))


@dataclass(frozen=True)
class Baseline:
    tokens_per_s: float = spec(help="the baseline's tokens per second", range=_RATE)
    cost_per_hour: float = spec(help="the baseline's $ per hour", range=_DOLLARS)
    gpus: dict[str, int] = spec(help="GPU type -> GPUs", range=_GPUS)
    note: str = ""
    tokens_per_s_low: float | None = spec(
        None,
        "low end of tokens_per_s's interval, as the plan's (planner/interval.py; null: none found)",
        _RATE,
    )
    tokens_per_s_high: float | None = spec(None, "high end of tokens_per_s's interval", _RATE)


@dataclass(frozen=True)
class SolverInfo:
    solve_time_s: float = spec(help="seconds the solver took", range=_SECONDS)
    status: str = spec(help="optimal | feasible | timeout | single_type")
    iterations: int = spec(help="repartition iterations", range=between(0, 1_000_000))
    gap: float | None = spec(
        help="proven relative gap to the optimum (0 when proven optimal; null when no bound is known)",
        range=between(0, 1e9),
    )
    mode: str = "two_phase"  # two_phase | exhaustive | as_written (plan --as-written: no search)
    window_steps: int = spec(
        1,
        "δ(η): training steps per weight update of the rollout servers (1: every step, as upstream); costs are "
        "averaged over it",
        between(1, 1_000_000),
    )
    enumerated: str = spec("", "exhaustive mode: the plans the brute force covered (planner/brute.py)")


@dataclass(frozen=True)
class Staleness:
    """Upstream's admission settings; ``max_concurrent_rollouts`` counts rollouts (prompts), as upstream does."""

    max_head_offpolicyness: int = spec(help="the staleness bound η (0: on-policy)", range=between(0, 1_000))
    max_concurrent_rollouts: int = spec(
        help="rollouts in flight: the planned in-flight cap", range=between(1, 10_000_000)
    )


@dataclass(frozen=True)
class ParetoPoint:
    cost_per_hour: float = spec(help="$ per hour", range=_DOLLARS)
    tokens_per_s: float = spec(help="tokens per second", range=_RATE)
    gpus: dict[str, int] = spec(help="GPU type -> GPUs", range=_GPUS)


@dataclass(frozen=True)
class Objective:
    kind: str = spec(help="what the plan optimised", choices=OBJECTIVES)
    budget_per_hour: float | None = spec(None, "the $/h budget", between(0, 1e9, "$/h"))
    target_tokens_per_s: float | None = spec(None, "the tokens/s target", _RATE)
    pick: str = spec(
        "cheapest_within_interval",
        "cheapest_within_interval | fastest | knee: how the plan was picked from the frontier",
        choices=PICKS,
    )
    throughput_tolerance: float = spec(
        0.0, "the plan is the cheapest within this share of the fastest's tokens/s", between(0, 0.5)
    )
    tie_band: float | None = spec(
        None,
        "with pick=cheapest_within_interval: the share of the fastest's tokens/s the plans tied within (max of 2% "
        "and the fit's residual spread)",
        between(0, 1),
    )


LIMITS = ("train", "rollout", "weight_sync", "budget", "target", "inventory")
ROLE_REASONS = ("compute_bound", "hbm_bound", "shared", "outside_search", "no_gain")


@dataclass(frozen=True)
class Binding:
    """What limits the chosen plan, for programs (``HexPlan.binding`` says it in words)."""

    slower: str = spec(help="the slower side of the step", choices=("train", "rollout"))
    limits: list[str] = spec(help="every limit that binds, the slower side first", choices=LIMITS)
    train_s: float = spec(help="training per step", range=_SECONDS)
    rollout_s: float = spec(help="generation plus reward per step", range=_SECONDS)
    sync_s: float = spec(
        help="weight sync per step (one update every window_steps steps, averaged)", range=_SECONDS
    )
    budget_left_per_hour: float | None = spec(None, "$/h of the budget left unspent", _DOLLARS)
    sync_update_s: float = spec(0.0, "one weight update of the rollout servers", _SECONDS)
    window_steps: int = spec(1, "training steps per weight update", between(1, 1_000_000))


@dataclass(frozen=True)
class PoolRole:
    """Why a pool got its role, for programs (``HexPlan.pool_roles`` says it in words)."""

    train: int = spec(help="machines training", range=_INDEX)
    rollout: int = spec(help="machines generating", range=_INDEX)
    idle: int = spec(help="machines left idle", range=_INDEX)
    reason: str = spec(help="why", choices=ROLE_REASONS)
    best_per_dollar: bool = spec(
        help="the best TFLOPS per $ (training) or HBM TB/s per $ (rollout) of all pools"
    )
    tflops_per_dollar: float = spec(help="dense BF16 TFLOPS per $ per GPU-hour", range=between(0, 1e9))
    hbm_tb_per_s_per_dollar: float = spec(help="HBM TB/s per $ per GPU-hour", range=between(0, 1e9))
    split: int = spec(0, "machines split between training and rollout (some GPUs each)", _INDEX)


CHANGE_KINDS = ("lost", "gained", "reshare", "drift", "replan", "auto_replan", "relayout")


@dataclass(frozen=True)
class PlanChange:
    """One change to a running plan: a server lost or gained, shares re-solved for length drift, a re-plan
    (``areal-hex replan``) or one the run applied on its own (``auto_replan``: the online refit's, live or at a
    recover checkpoint, ``areal/auto_replan.py``), a machine moved by a live re-layout (``relayout``,
    ``areal/elastic/relayout.py``). ``shares`` are the routing shares after it, per server (``pool/index``)."""

    kind: str = spec(help="what changed", choices=CHANGE_KINDS)
    hosts: list[str] = spec(
        help="the machines (or servers) concerned", default_factory=list, max_items=1 << 16
    )
    reason: str = spec("", "why, in words")
    step: int | None = spec(
        None, "the training step it happened in (None: between runs)", between(0, 1 << 40)
    )
    tokens_per_s_before: float = spec(0.0, "predicted tokens/s before", _RATE)
    tokens_per_s_after: float = spec(0.0, "predicted tokens/s after", _RATE)
    shares: dict[str, float] = spec(
        help="routing share of each server after the change", range=between(0, 1), default_factory=dict
    )


_ELASTICITY = between(-1e6, 1e6)


@dataclass(frozen=True)
class Elasticity:
    """How the chosen plan moves with one input, the plan held (``planner/sensitivity.py``): d ln(number) /
    d ln(input) by central differences; null where the input is 0 or does not move, or the number is 0."""

    value: float = spec(
        help="the input's value in the plan's calibration or workload", range=between(0, 1e12)
    )
    tokens_per_s: float | None = spec(
        help="elasticity of the plan's predicted tokens/s (its $/h does not move)", range=_ELASTICITY
    )
    vs_best_baseline: float | None = spec(
        help="elasticity of its tokens/s over the best homogeneous baseline's, each held (null: no baseline)",
        range=_ELASTICITY,
    )


@dataclass(frozen=True)
class Flip:
    """A change of one input at which the objective, re-ranking the plans the searches scored, picks another."""

    group: str = spec(help="the GPU type whose factor changed, or workload")
    input: str = spec(help="the factor or workload figure changed")
    change: float = spec(help="its relative change", range=between(-1, 1e6))
    value: float = spec(help="its value after the change", range=between(0, 1e12))
    train: dict[str, int] = spec(help="GPU type -> GPUs training in the plan picked instead", range=_GPUS)
    rollout: dict[str, int] = spec(help="GPU type -> GPUs generating in it", range=_GPUS)
    cost_per_hour: float = spec(help="its $ per hour", range=_DOLLARS)
    tokens_per_s: float = spec(help="its tokens/s after the change", range=_RATE)
    chosen_tokens_per_s: float = spec(help="the chosen plan's tokens/s after the change", range=_RATE)


@dataclass(frozen=True)
class Sensitivity:
    """What the ranking hangs on (``areal-hex plan``; ``planner/sensitivity.py``)."""

    step: float = spec(
        help="relative change of each input for the elasticities (+ and -)", range=between(0, 0.5)
    )
    factors: dict[str, dict[str, Elasticity]] = spec(help="GPU type -> calibrated factor -> elasticity")
    workload: dict[str, Elasticity] = spec(
        help="mean_tokens, sigma (of ln length below the cap), cap_share (where some samples reach the cap) -> "
        "elasticity"
    )
    flip_change: float = spec(
        help="relative change of each input the flip check tries (+ and -)", range=between(0, 1)
    )
    candidates: int = spec(
        help="plans the flip check re-ranks (the splits the searches scored, not re-solved)",
        range=between(0, 1 << 40),
    )
    flips: list[Flip] = spec(
        help="the changes that flip the chosen plan", default_factory=list, max_items=1 << 16
    )
    interval_flips: list[Flip] = spec(
        help="factors at an end of their interval (planner/interval.py) at which another plan would be picked",
        default_factory=list,
        max_items=1 << 16,
    )


@dataclass(frozen=True)
class HexPlan:
    """Which machine does what, with which layouts, and what that is predicted to buy."""

    recipe: str = spec(help="the recipe file planned")
    model: str = spec(help="the model's name")
    objective: Objective = spec(help="what the plan optimised")
    predicted: Predicted = spec(help="the chosen plan's predicted step and throughput")
    train: TrainPlan = spec(help="the training layout")
    rollout: RolloutPlan = spec(help="the rollout replica groups")
    machines: list[Machine] = spec(
        help="every machine of the inventory, with what each GPU serves", max_items=MAX_MACHINES * MAX_POOLS
    )
    baselines: dict[str, Baseline] = spec(help="name -> what a simpler deployment would do")
    solver: SolverInfo = spec(help="how the solver fared")
    staleness: Staleness = spec(help="upstream's admission settings for this plan")
    binding: str = spec("", "the constraint that limits throughput, in words")
    pool_roles: dict[str, str] = spec(help="pool -> why it got its role, in words", default_factory=dict)
    binding_constraint: Binding | None = spec(None, "the binding constraint as fields")
    pool_role_reasons: dict[str, PoolRole] = spec(
        help="pool -> its role's reason as fields", default_factory=dict
    )
    pareto: list[ParetoPoint] = spec(
        help="the cost vs tokens/s frontier (plan --pareto, or hex.objective.pick=knee); the plan is on it",
        default_factory=list,
    )
    alternatives: dict[str, ParetoPoint] = spec(
        help="beside the plan, on the frontier within the objective: cheapest_within_2pct (the cheapest plan "
        "within 2% of the fastest plan's tokens/s) and knee (the fastest within 2% of the frontier's lowest $ per token)",
        default_factory=dict,
    )
    warnings: list[str] = spec(help="what the planner warns about", default_factory=list)
    runtime: str = spec("", "the runtime the plan was made for (RuntimeCaps.describe())")
    changes: list[PlanChange] = spec(
        help="what changed since the plan was made, in order (lost and gained servers, re-plans)",
        default_factory=list,
        max_items=1 << 16,
    )
    sensitivity: Sensitivity | None = spec(
        None,
        "what the ranking hangs on: elasticities to each factor and the workload, and flips (areal-hex plan)",
    )
    schema_version: int = spec(SCHEMA_VERSION, "the plan format's version", between(1, SCHEMA_VERSION))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {"schema_version": data.pop("schema_version"), **data}

    @staticmethod
    def from_dict(data: Any, source: str = "plan") -> HexPlan:
        if not isinstance(data, dict):
            raise HexError(
                source,
                f"must be a JSON object, got {type(data).__name__}",
                "give a plan written by areal-hex plan --json",
            )
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise HexError(
                f"{source}.schema_version",
                f"is {version!r}, this areal-hex reads version {SCHEMA_VERSION}",
                "re-create the plan with this version: areal-hex plan RECIPE --json OUT",
            )
        plan = typed.build(HexPlan, data, source, strict=True)
        _check(plan, source)
        return plan

    def save(self, path: str | Path) -> Path:
        from areal_hex_plugin.outfiles import write_json

        return write_json(path, self.to_dict())

    @staticmethod
    def load(path: str | Path, field: str = "plan") -> HexPlan:
        """The plan saved at ``path`` (``field``: the option or key that named the file, for messages)."""
        data = read_json(path, field, "give a plan written by areal-hex plan RECIPE --json PLAN.json")
        return HexPlan.from_dict(data, "plan")

    def machines_with_role(self, role: str) -> list[Machine]:
        """The machines that train, generate, do both or stay idle (``role`` in :data:`MACHINE_ROLES`)."""
        return [m for m in self.machines if m.role == role]


_REPLAN = "re-create the plan: areal-hex plan RECIPE --json PLAN.json"
# How far a plan's shares may sum from 1: a hand-edited plan rounds them (to 6 places in tests/elastic/plans.py).
_SHARES_OFF = 1e-3


def _check(plan: HexPlan, source: str) -> None:
    """Cross-field checks a consumer relies on: what every plan the planner writes has (a runtime, a positive
    predicted step and throughput, shares of the whole step) and every referenced stage/group exists."""
    for name in ("tokens_per_s", "step_time_s"):
        if getattr(plan.predicted, name) <= 0:
            raise HexError(f"{source}.predicted.{name}", "is 0: the planner predicts a positive one", _REPLAN)
    if not plan.runtime:
        raise HexError(
            f"{source}.runtime", "is empty: the plan does not say which runtime it is for", _REPLAN
        )
    _check_interval(plan.predicted, f"{source}.predicted", ("tokens_per_s", "step_time_s"))
    logp = plan.predicted.train_logp_s
    if logp is not None and logp > plan.predicted.train_time_s * (1 + 1e-6) + 1e-4:
        raise HexError(
            f"{source}.predicted.train_logp_s",
            f"is {logp:g}, more than the train time {plan.predicted.train_time_s:g} it is part of",
            _REPLAN,
        )
    for name, baseline in plan.baselines.items():
        _check_interval(baseline, f"{source}.baselines.{name}", ("tokens_per_s",))
    shares = sum(g.share for g in plan.rollout.replicas)
    if plan.rollout.replicas and abs(shares - 1) > _SHARES_OFF:
        raise HexError(
            f"{source}.rollout.replicas",
            f"the shares sum to {shares:g}, not 1: they split each step's samples",
            _REPLAN,
        )
    n_stages = len(plan.train.stages)
    n_groups = len(plan.rollout.replicas)
    for i, machine in enumerate(plan.machines):
        for j, gpu in enumerate(machine.gpus):
            where = f"{source}.machines[{i}].gpus[{j}]"
            if gpu.role == "train" and not (gpu.stage is not None and gpu.stage < n_stages):
                raise HexError(f"{where}.stage", f"no train stage {gpu.stage!r}", _REPLAN)
            if gpu.role == "rollout" and not (gpu.group is not None and gpu.group < n_groups):
                raise HexError(f"{where}.group", f"no replica group {gpu.group!r}", _REPLAN)


def _check_interval(block: Predicted | Baseline, where: str, names: tuple[str, ...]) -> None:
    """An interval, where a prediction has one (a plan saved before intervals has none), holds its value: low <=
    value <= high (to the rounding of a saved plan), both ends or neither (a step's high end may be null:
    unbounded)."""
    for name in names:
        value, low, high = (getattr(block, f"{name}{end}") for end in ("", "_low", "_high"))
        if low is None and high is None:
            continue
        if low is None or (high is None and name != "step_time_s"):
            missing = f"{name}_low" if low is None else f"{name}_high"
            raise HexError(f"{where}.{missing}", "is missing beside the other end of the interval", _REPLAN)
        slack = 1e-6 * abs(value) + 1e-3
        end = "_low" if value < low - slack else "_high" if high is not None and value > high + slack else ""
        if end:
            shown = f"{high:g}" if high is not None else "unbounded"
            raise HexError(
                f"{where}.{name}{end}",
                f"the interval {low:g} to {shown} does not hold {name}={value:g}",
                _REPLAN,
            )


def load_plan_for(path: str | Path, cluster: Cluster, model: ModelShape, field: str) -> HexPlan:
    """The plan at ``path`` (named by ``field``), checked against the recipe's cluster and model."""
    plan = HexPlan.load(path, field)
    check_plan_fits(plan, cluster, model)
    return plan


def check_plan_fits(plan: HexPlan, cluster: Cluster, model: ModelShape, source: str = "plan") -> None:
    """Refuse a plan that does not fit the recipe it is used with, before anything uses it.

    ``cluster`` is the recipe's cluster (the driver checks the live inventory afterwards): the plan's model is the
    recipe's; every pool it names exists with the same GPU type; its machines are the pool's hosts (or its
    numbered machines), each listed once, with GPU indices inside the machine; train stages hold layers that sum
    to the model's, and fit their pool; replica groups fit their pool, each TP group inside one machine; the GPUs
    assigned to each stage and group are as many as it needs, on its own pool; no pool gives more GPUs than it has.
    """
    if plan.model != model.name:
        raise HexError(
            f"{source}.model",
            f"the plan was made for model {plan.model}, the recipe trains {model.name}",
            "re-plan for this recipe (areal-hex plan RECIPE --json PLAN) or use the recipe it was made for",
        )
    pools = {p.name: p for p in cluster.pools}

    def pool_of(name: str, gpu_type: str, where: str, tp: int = 1):
        """The recipe's pool for a stage or group, which must hold its GPU type and a TP group per machine."""
        pool = pools.get(name)
        if pool is None:
            raise HexError(
                f"{where}.pool",
                f"the plan uses pool {name!r}, which the recipe's cluster does not have "
                f"(pools: {', '.join(pools)})",
                "re-plan for this cluster (areal-hex plan RECIPE --json PLAN)",
            )
        if gpu_type != pool.gpu_type:
            raise HexError(
                f"{where}.gpu_type",
                f"the plan puts {gpu_type} GPUs in pool {name!r}, but the recipe's cluster has {pool.gpu_type} there",
                "re-plan for this cluster",
            )
        if tp > pool.gpus_per_machine:
            raise HexError(
                f"{where}.tp", f"is {tp}, but {pool.name} machines have {pool.gpus_per_machine} GPUs", _REPLAN
            )
        return pool

    used: dict[str, int] = {name: 0 for name in pools}
    for i, stage in enumerate(plan.train.stages):
        where = f"{source}.train.stages[{i}]"
        pool = pool_of(stage.pool, stage.gpu_type, where, stage.tp)
        used[pool.name] += stage.dp * stage.tp
    layers = sum(s.layers for s in plan.train.stages)
    if plan.train.stages and layers != model.layers:
        raise HexError(
            f"{source}.train.stages",
            f"hold {layers} layers in all, but {model.name} has {model.layers}",
            _REPLAN,
        )
    for i, group in enumerate(plan.rollout.replicas):
        where = f"{source}.rollout.replicas[{i}]"
        pool = pool_of(group.pool, group.gpu_type, where, group.tp)
        if group.pp > model.layers:
            raise HexError(
                f"{where}.pp", f"is {group.pp}, but {model.name} has {model.layers} layers", _REPLAN
            )
        used[pool.name] += group.count * group.tp * group.pp
    for name, gpus in used.items():
        if gpus > pools[name].n_gpus:
            raise HexError(
                f"{source}.machines",
                f"the plan uses {gpus:,} GPUs of pool {name!r}, which has {pools[name].n_gpus:,}",
                "re-plan for the machines you have now",
            )
    _check_machines(plan, pool_of, source)


def _check_machines(plan: HexPlan, pool_of, source: str) -> None:
    """Each machine once, on a host its pool has, GPU indices inside it, GPUs on the pool of their stage/group."""
    seen: set[str] = set()
    assigned: dict[tuple[str, int], int] = {}
    hosts: dict[str, set[str]] = {}
    for i, machine in enumerate(plan.machines):
        where = f"{source}.machines[{i}]"
        pool = pool_of(machine.pool, machine.gpu_type, where)
        if pool.name not in hosts:
            hosts[pool.name] = {pool.host(k) for k in range(pool.machines)}
        if machine.host not in hosts[pool.name]:
            raise HexError(
                f"{where}.host",
                f"the plan uses host(s) {machine.host} of pool {pool.name!r}, which the recipe's cluster lacks",
                "re-plan for the machines you have now",
            )
        if machine.host in seen:
            raise HexError(f"{where}.host", f"{machine.host} is listed twice", _REPLAN)
        seen.add(machine.host)
        indices = [g.gpu for g in machine.gpus]
        if len(set(indices)) != len(indices):
            raise HexError(f"{where}.gpus", "lists a GPU index twice", _REPLAN)
        for j, gpu in enumerate(machine.gpus):
            if gpu.gpu >= pool.gpus_per_machine:
                raise HexError(
                    f"{where}.gpus[{j}].gpu",
                    f"is GPU {gpu.gpu}, but {pool.name} machines have GPUs 0-{pool.gpus_per_machine - 1}",
                    _REPLAN,
                )
            if gpu.role == "idle":
                continue
            owner = plan.train.stages[gpu.stage] if gpu.role == "train" else plan.rollout.replicas[gpu.group]
            if owner.pool != machine.pool:
                raise HexError(
                    f"{where}.gpus[{j}]",
                    f"serves a {gpu.role} {'stage' if gpu.role == 'train' else 'group'} of pool {owner.pool!r} "
                    f"on a machine of pool {machine.pool!r}",
                    _REPLAN,
                )
            key = (gpu.role, gpu.stage if gpu.role == "train" else gpu.group)
            assigned[key] = assigned.get(key, 0) + 1
    needs = {("train", i): s.dp * s.tp for i, s in enumerate(plan.train.stages)}
    needs |= {("rollout", i): g.count * g.tp * g.pp for i, g in enumerate(plan.rollout.replicas)}
    for (role, index), need in needs.items():
        if assigned.get((role, index), 0) != need:
            what = f"train.stages[{index}]" if role == "train" else f"rollout.replicas[{index}]"
            raise HexError(
                f"{source}.{what}",
                f"needs {need:,} GPUs, but the plan's machines give it {assigned.get((role, index), 0):,}",
                _REPLAN,
            )
