"""Calibration against measured AReaL runs: the paper's homogeneous baselines (``recipes/paper/baselines.json``).

The file holds, per model and GPU type, what AReaL measured on one GPU type (Fig. 3/4: tokens/s and seconds per
step of rollout, training and weight sync) and the tokens per step each run implies. The mixed-cluster results
are not in it and nothing here looks at them: they are what the calibrated model must predict.

Each run is priced by the runtime every other command prices a step with: upstream 1.0.4's loop
(``planner/inflight.py``, :func:`~areal_hex_plugin.planner.inflight.held_rollout_s`: admission by
``max_concurrent_rollouts`` within the staleness bound, the KV rebuild after each update, the tail, the wait of a
step whose admission cannot replace a batch during training). What the paper does not state about its runs is a
parameter of that runtime (:class:`MeasuredSetting`, recorded in the profile with its evidence): their
staleness bound eta is fitted with the factors (the candidate ``ETAS`` whose in-range fit misses least), their
admission is upstream's default (``max_concurrent_rollouts`` unset: one consumer batch), their replicas the
file's ``rollout_layout``, their split the one their phases show (H800) or the best one (H20), their tokens per
step each run's own (:func:`measured_workload`). Then, every factor searched within its physical range
(``calibration.RANGES``):

1. H800 (``reference``): ``hbm_fraction`` and ``decode_overhead_s`` to the three models' rollout times,
   ``train_mfu`` to their training times, on the measured cluster split the way its phases show (two 8-GPU
   machines generate, one trains);
2. every other type (H20): its runs are train-bound (their phases are equal, rollout waiting at the
   staleness bound), so they show the step, not the rollout speed. It takes the reference's
   ``decode_overhead_s`` (the same SGLang stack); ``hbm_fraction`` and ``infer_mfu`` are fitted to Table 1's
   per-GPU rollout cost ratio against the fitted reference, ``train_mfu`` to Table 1's training ratio and
   the runs' steps together (:func:`balanced_step`: the best whole-machine split of the cluster). Where the
   file leaves the GPU count open (``gpus: null``: the paper's H20 runs), each whole-machine count up to
   ``max_gpus`` is fitted and the best kept;
3. every type: ``update_gb_per_s`` and ``update_fixed_s`` to Table 2's AReaL column of that type.

Where no factors inside their ranges explain a measurement within TOLERANCE, the runtime does not change: the fit
keeps the best factors inside and names the measurement it cannot explain (``BaselineFit.unexplained``: what it
measured, what the model gives, the factor value it would need), which ``areal-hex calibrate`` prints and records.
The planner's phases and tokens/s on the measured clusters with the fitted factors are the check
(``sim/baselines.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cache, partial
from pathlib import Path
from typing import Any

from areal_hex_plugin.costmodel.calibration import BUILTIN, PROFILE_FORMAT, RANGES, Calibration
from areal_hex_plugin.costmodel.fit import grid_search
from areal_hex_plugin.costmodel.model import CostModel
from areal_hex_plugin.costmodel.rollout import RolloutStage
from areal_hex_plugin.costmodel.single_type import SINGLE_TYPE_MAX_PP, best_rollout
from areal_hex_plugin.costmodel.train import TrainStage
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.planner.inflight import InFlight, held_rollout_s
from areal_hex_plugin.planner.rollout_model import ReplicaConfig
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.config import OutputLengthConfig
from areal_hex_plugin.specs.files import read_format
from areal_hex_plugin.specs.rental import rent
from areal_hex_plugin.specs.workload import LengthDistribution, RLSettings, WorkloadSpec

BASELINES_FORMAT = "areal-hex-baselines/1"
# The staleness bounds the measured runs may have had (the paper does not state theirs); the fit keeps the one
# whose factors inside their ranges miss the reference's rollout seconds least.
ETAS = (0, 1, 2, 4, 8)
PHASES = ("rollout_s", "train_s", "weight_sync_s")
# Measured phases this close are one step seen twice (one phase waited for the other).
EQUAL_PHASES = 0.01
GRID = {"points": 10, "refine": 3}
# A search this far past a range's ends finds the factor a measurement would need; beyond the range the measurement
# is named as unexplained when the best fit inside misses it by more than TOLERANCE.
WIDEN = 4.0
TOLERANCE = 0.15


@dataclass(frozen=True)
class Setting:
    """One measured model: its recipe's cluster (every pool the file names), workload and length shape."""

    cluster: Cluster
    workload: WorkloadSpec
    max_pp: int
    lengths: OutputLengthConfig = field(default_factory=OutputLengthConfig)


@dataclass(frozen=True)
class MeasuredSetting:
    """The measured runs' settings the paper does not state, as the fit found or assumed them."""

    eta: dict[str, int]  # model -> its runs' staleness bound
    evidence: dict[str, str] = field(default_factory=dict)  # setting -> why

    def as_dict(self, gpus: Mapping[str, int], layouts: Mapping[str, Any]) -> dict[str, Any]:
        """The profile's ``measured_setting`` entry."""
        return {
            "max_head_offpolicyness": dict(self.eta),
            "max_concurrent_rollouts": "consumer_batch_size (upstream's default where unset)",
            "update_window": 1,
            "gpus": dict(gpus),
            "rollout_layout": {c: list(v) if v else None for c, v in layouts.items()},
            "evidence": dict(self.evidence),
        }


@dataclass(frozen=True)
class BaselineFit:
    calibration: Calibration
    factors: dict[str, dict[str, float]]
    sources: dict[str, dict[str, str]]
    points: list[dict[str, Any]]  # each fitted measurement next to the fitted model's value
    gpus: dict[str, int] = field(default_factory=dict)  # GPUs of each measured cluster (given or fitted)
    setting: MeasuredSetting = field(default_factory=lambda: MeasuredSetting({}))
    # The measurements no factors inside their ranges explain within TOLERANCE (each with the value it needs).
    unexplained: list[dict[str, Any]] = field(default_factory=list)


def _num(data: Mapping, key: str, where: str) -> float:
    value = data.get(key) if isinstance(data, Mapping) else None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise HexError("baselines", f"{where}.{key} is missing or not a positive number", "fix the file")
    return float(value)


def check_baselines(data: object) -> dict:
    """The baselines file, checked: format, reference type, clusters and per-model phases and tokens per step."""
    if not isinstance(data, dict) or data.get("format") != BASELINES_FORMAT:
        raise HexError(
            "baselines", "is not an areal-hex baselines file", f"expected format {BASELINES_FORMAT!r}"
        )
    clusters, models = data.get("clusters"), data.get("models")
    if not isinstance(clusters, dict) or not isinstance(models, dict) or not models:
        raise HexError("baselines", "needs clusters and models sections", "see recipes/paper/baselines.json")
    if data.get("reference") not in clusters:
        raise HexError("baselines", "reference must name one of the clusters", "e.g. reference: h800")
    for name, c in clusters.items():
        if name == data["reference"] or c.get("gpus") is not None:
            _num(c, "gpus", f"clusters.{name}")
        else:  # not stated by the run's source: fitted to its steps in whole machines up to max_gpus
            _num(c, "max_gpus", f"clusters.{name}")
        if not isinstance(c.get("gpu_type"), str):
            raise HexError("baselines", f"clusters.{name}.gpu_type is missing", "give the catalog name")
        layout = c.get("rollout_layout")
        if layout is not None and not (
            isinstance(layout, list)
            and len(layout) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in layout)
        ):
            raise HexError("baselines", f"clusters.{name}.rollout_layout must be [tp, pp]", "e.g. [1, 1]")
    for model, per in models.items():
        for name in clusters:
            run = per.get(name, {})
            where = f"models.{model}.{name}"
            for phase in PHASES:
                _num(run, phase, where)
            step = run["weight_sync_s"] + max(run["rollout_s"], run["train_s"])
            implied = _num(run, "tokens_per_s", where) * step
            if abs(_num(run, "tokens_per_step", where) / implied - 1) > 0.01:
                raise HexError(
                    "baselines",
                    f"{where}.tokens_per_step {run['tokens_per_step']:,.0f} is not tokens_per_s x (weight sync + "
                    f"max(rollout, train)) = {implied:,.0f}",
                    "derive it from the run's figures (see _tokens_per_step in recipes/paper/baselines.json)",
                )
    return data


def areal_runtime(rl: RLSettings, eta: int) -> RLSettings:
    """``rl`` as the measured AReaL runs had it: one batch of rollouts admitted at once (upstream's default
    ``max_concurrent_rollouts``), weights every step, the staleness bound ``eta``, no even-dispatch rule (their
    AReaL version and DP layout are not stated)."""
    return replace(
        rl,
        max_admitted=rl.consumer_batch_size,
        max_update_window=1,
        even_dispatch=False,
        max_head_offpolicyness=eta,
    )


def measured_workload(setting: Setting, tokens_per_step: float, eta: int) -> WorkloadSpec:
    """The recipe's workload as a measured AReaL run had it: ``tokens_per_step`` (the mean output length that
    gives it, the recipe's length shape kept), one batch of rollouts admitted at once, weights every step, at
    the staleness bound ``eta``."""
    w = setting.workload
    rl = areal_runtime(w.rl, eta)
    mean = tokens_per_step / rl.samples_per_step - w.prompt_tokens
    cfg = setting.lengths
    if cfg.kind != "lognormal" or mean <= cfg.cap_share * rl.max_new_tokens:
        raise HexError(
            "baselines",
            f"{w.model.name}: {tokens_per_step:,.0f} tokens per step leave a mean of {mean:,.0f} output tokens, "
            f"which the recipe's length shape ({cfg.kind}, cap_share {cfg.cap_share:g}) cannot have",
            "give the recipe a lognormal length shape whose cap share fits the run's mean",
        )
    lengths = LengthDistribution.lognormal(mean, cfg.sigma, rl.max_new_tokens, cap_share=cfg.cap_share)
    return replace(w, rl=rl, output_lengths=lengths)


def train_s(cm: CostModel, pool: str, gpus: int, max_pp: int) -> float:
    """Fastest training step on exactly ``gpus`` GPUs of ``pool``."""
    p = cm.cluster.pool(pool)
    best = math.inf
    for pp in (d for d in range(1, min(max_pp, gpus) + 1) if gpus % d == 0):
        for tp in (d for d in range(1, p.gpus_per_machine + 1) if (gpus // pp) % d == 0):
            est = cm.train(tuple(TrainStage(pool, gpus // pp // tp, tp) for _ in range(pp)))
            if est.feasible:
                best = min(best, est.step_time_s)
    return best


def measured_shape(
    cm: CostModel, pool: str, max_pp: int, layout: tuple[int, int] | None = None
) -> tuple[RolloutStage, ...] | None:
    """The replica shape a measured run used: its cluster's ``rollout_layout`` (tp, pp) where the file gives
    one, else the shape with the most tokens/s per GPU at a full batch."""
    if layout:
        return tuple(RolloutStage(pool, layout[0]) for _ in range(layout[1]))
    stages, est = best_rollout(cm, cm.cluster.pool(pool), max_pp)
    return stages if est is not None and est.feasible else None


def rollout_s(
    cm: CostModel,
    pool: str,
    gpus: int,
    max_pp: int,
    layout: tuple[int, int] | None = None,
    train: float = 0.0,
) -> tuple[float, tuple, int]:
    """Seconds per step the trainer waits for rollout on ``gpus`` GPUs of ``pool`` filled with copies of the
    measured shape, the sequences admission lets in shared evenly, beside a training step of ``train`` seconds,
    as upstream's loop runs them (:func:`~areal_hex_plugin.planner.inflight.held_rollout_s`, the runtime of every
    command); with the shape and count."""
    stages = measured_shape(cm, pool, max_pp, layout)
    count = gpus // sum(s.tp for s in stages) if stages else 0
    if count == 0:
        return math.inf, stages or (), 0
    full = cm.rollout(stages)
    if not full.feasible:
        return math.inf, stages, count
    # The planner's cap: the sequences admission lets in, shared evenly and rounded down (``InFlight.caps``).
    shape = ReplicaConfig(pool, stages[0].tp, len(stages), full.tokens_per_s, full.concurrency)
    (cap,) = InFlight.caps(((shape, count),), 1.0, cm.staleness_sequences())
    est = cm.rollout(stages, max_sequences=cap)
    config = replace(
        shape, tokens_per_s=est.tokens_per_s, concurrency=est.concurrency, recompute_s=est.recompute_s,
        longest_s=est.longest_s, drain_s=est.drain_s,
    )  # fmt: skip
    return held_rollout_s(cm, ((config, count),), 1, 0, train), stages, count


def balanced_step(
    cm: CostModel, pool: str, gpus: int, max_pp: int, layout: tuple[int, int] | None = None
) -> tuple[float, int]:
    """The shortest step max(train, rollout) over splits of ``gpus`` GPUs of ``pool`` that train on whole
    machines, and the GPUs that train."""
    per_machine = cm.cluster.pool(pool).gpus_per_machine
    best = (math.inf, 0)
    for train_gpus in range(per_machine, gpus, per_machine):
        train = train_s(cm, pool, train_gpus, max_pp)
        step = max(train, rollout_s(cm, pool, gpus - train_gpus, max_pp, layout, train)[0])
        best = min(best, (step, train_gpus))
    return best


def reference_split(cm: CostModel, pool: str, gpus: int) -> int:
    """GPUs that train in the reference's measured runs: one machine in three (its phases: two 8-GPU machines
    generate while one trains)."""
    per_machine = cm.cluster.pool(pool).gpus_per_machine
    return per_machine * max(1, (gpus // per_machine) // 3)


def measured_phases(
    cm: CostModel, pool: str, gpus: int, train_gpus: int, max_pp: int, layout: tuple[int, int] | None
) -> dict[str, float]:
    """A measured run's step as the fit prices it, in upstream's loop (the runtime every command uses): the
    fastest training on ``train_gpus`` GPUs of ``pool``, the rest generating with copies of the measured shape,
    upstream's weight transport to them; tokens/s the paper's metric (tokens per step over weight sync +
    max(rollout, train))."""
    train = train_s(cm, pool, train_gpus, max_pp)
    rollout, shape, count = rollout_s(cm, pool, gpus - train_gpus, max_pp, layout, train)
    weights = cm.workload.model.weight_bytes()
    sync = cm.weight_sync({pool: weights}, [(shape, count)]).seconds if count else math.inf
    step = sync + max(rollout, train)
    return {
        "rollout_s": rollout,
        "train_s": train,
        "weight_sync_s": sync,
        "tokens_per_s": cm.workload.tokens_per_step / step,
        "train_gpus": train_gpus,
    }


def _per_gpu(cm: CostModel, pool: str, max_pp: int) -> float:
    """Generated tokens/s per GPU of ``pool``'s best single-type replica at a full batch (0 if none fits)."""
    _, roll = best_rollout(cm, cm.cluster.pool(pool), max_pp)
    return roll.tokens_per_s / roll.n_gpus if roll is not None and roll.feasible else 0.0


def per_gpu_ratio(calibration: Calibration, setting: Setting, pool: str, ref_pool: str) -> float:
    """Generated tokens/s per GPU of ``pool``'s best replica over ``ref_pool``'s, at a full batch (Table 1's
    rollout speed ratio)."""
    cm = CostModel(setting.cluster, setting.workload, calibration)
    ref = _per_gpu(cm, ref_pool, setting.max_pp)
    return _per_gpu(cm, pool, setting.max_pp) / ref if ref else math.inf


def train_ratio(calibration: Calibration, setting: Setting, pool: str, ref_pool: str) -> float:
    """Training tokens/s per GPU of one machine of ``pool`` over one of ``ref_pool`` (Table 1's training speed
    ratio): the same step, so the inverse ratio of the step times, per GPU."""
    cm = CostModel(setting.cluster, setting.workload, calibration)
    n, n_ref = (cm.cluster.pool(p).gpus_per_machine for p in (pool, ref_pool))
    return train_s(cm, ref_pool, n_ref, setting.max_pp) * n_ref / (train_s(cm, pool, n, setting.max_pp) * n)


def _log_loss(pairs) -> float:
    return sum(math.log(model / measured) ** 2 for model, measured in pairs)


def _bounds(factor: str, widen: float = 1.0) -> tuple[float, float]:
    r = RANGES[factor]
    high = r.high * widen
    return r.low / widen, min(high, 1.0) if r.high <= 1.0 else high


def _fit_in_range(
    loss,
    points,
    gpu_type: str,
    names: tuple[str, str],
    unexplained: list | None = None,
    given: Calibration | None = None,
) -> tuple[float, float]:
    """The pair of factors ``names`` minimising ``loss``, inside their physical ranges; a factor ``given`` holds
    (not its built-in assumption) stays at its value. ``points(a, b)`` lists (label, model, measured) per
    measurement; where the best fit inside misses some by more than TOLERANCE, each of those (furthest off first) is
    added to ``unexplained`` (None: not checked) with the value a factor outside its range would need, or, where
    none would fit better, the factors no value of which explains it."""

    def bounds(name: str, widen: float = 1.0) -> tuple[float, float]:
        if given is not None and not given.assumed(gpu_type, name):
            value = getattr(given.for_gpu(gpu_type), name)
            return value, value
        return _bounds(name, widen)

    loss = cache(loss)  # a held factor repeats the grid's points
    inside = grid_search(loss, (bounds(names[0]), bounds(names[1])), **GRID)
    misses = sorted(
        (x for x in points(*inside) if abs(x[1] / x[2] - 1) > TOLERANCE),
        key=lambda x: -abs(math.log(x[1] / x[2])),
    )
    if unexplained is None or not misses:
        return inside
    wide = grid_search(loss, (bounds(names[0], WIDEN), bounds(names[1], WIDEN)), **GRID)
    out = [(n, v) for n, v in zip(names, wide, strict=True) if v not in RANGES[n]]
    if out:
        name, value = out[0]
        needs = (
            f"the fit outside the ranges puts {name} at {value:.3g}, outside its physical range {RANGES[name]} "
            f"({RANGES[name].why})"
        )
    else:
        free = " or ".join(dict.fromkeys(n for n in names if bounds(n)[0] < bounds(n)[1]))
        needs = f"no value of {free} explains it, inside its range or {WIDEN:g}x beyond (the rest held)"
    unexplained += [
        {
            "measurement": label,
            "measured": measured,
            "model_value": model,
            "gpu_type": gpu_type,
            "needs": needs,
        }
        for label, model, measured in misses
    ]
    return inside


def _ratio_points(
    calibration, gpu_type, names, ratio, target, settings, pool, ref_pool, label, a: float, b: float = 0.0
) -> list:
    """(label, model, measured) of each model's per-GPU speed ``ratio`` of ``pool`` over ``ref_pool`` with
    ``gpu_type``'s factors ``names`` at (a, b), against Table 1's ``target``."""
    cal = calibration.with_factors(gpu_type, dict(zip(names, (a, b), strict=False)))
    return [(f"{label} {m}", ratio(cal, settings[m], pool, ref_pool), target[m]) for m in target]


def _fit_train_mfu(
    calibration,
    gpu_type,
    target,
    settings,
    pool,
    ref_pool,
    step_of,
    steps,
    label,
    step_label,
    n: int,
    unexplained: list | None,
) -> tuple[float, float]:
    """The ``train_mfu`` of ``gpu_type`` fitting Table 1's training ratio and the runs' steps on ``n`` GPUs
    together, inside its range (checked into ``unexplained`` unless None): its loss and value."""

    def points(mfu: float, _: float = 0.0) -> list:
        """Table 1's training ratio points and each run's step at ``train_mfu`` = ``mfu``."""
        cal = calibration.with_factors(gpu_type, {"train_mfu": mfu})
        ratios = _ratio_points(
            calibration, gpu_type, ("train_mfu",), train_ratio, target, settings, pool, ref_pool, label, mfu
        )
        runs = [(f"{step_label} on {n} GPUs of {m}", step_of(m, n=n, cal=cal)[0], steps[m]) for m in steps]
        return ratios + runs

    loss = cache(partial(_points_loss, points))
    mfu, _ = _fit_in_range(lambda a, _: loss(a), points, gpu_type, ("train_mfu", "train_mfu"), unexplained)
    return loss(mfu), mfu


def _points_loss(points, a: float, b: float = 0.0) -> float:
    return _log_loss((x[1], x[2]) for x in points(a, b))


def _sync_loss(parts: Mapping, measured: Mapping, cluster: str, rate: float, fixed: float) -> float:
    return _log_loss(
        (net + size / (rate * 1e9) + fixed, measured[m][cluster]["weight_sync_s"])
        for m, (net, size) in parts.items()
    )


def fit_baselines(
    data: Mapping, settings: Mapping[str, Setting], calibration: Calibration | None = None, name: str = ""
) -> BaselineFit:
    """Fit every type's factors to ``data`` (checked by :func:`check_baselines`); ``settings`` maps each of its
    model names to the recipe setting. Factors ``calibration`` gives (a profile's, whatever source it states) are
    kept; the measured runs' staleness bound is the one of ``ETAS`` the reference's rollout seconds fit best."""
    data = check_baselines(data)
    calibration = calibration or Calibration()
    where = name or "baselines"
    ref = data["reference"]
    clusters = data["clusters"]
    models = [m for m in data["models"] if m in settings]
    if len(models) < 2:
        raise HexError("baselines", "fewer than two of its models have a recipe", "load the paper recipes")
    pool_of = {}
    for cname, c in clusters.items():
        base = settings[models[0]].cluster
        pools = [p for p in base.pools if p.gpu_type == c["gpu_type"]]
        if not pools:
            raise HexError(
                "baselines", f"clusters.{cname}: no {c['gpu_type']} pool in the recipes", "add one"
            )
        pool_of[cname] = pools[0].name
    points: list[dict[str, Any]] = []
    unexplained: list[dict[str, Any]] = []
    workloads = {
        (m, c, eta): measured_workload(settings[m], float(data["models"][m][c]["tokens_per_step"]), eta)
        for m in models
        for c in clusters
        for eta in ETAS
    }
    eta_of = dict.fromkeys(models, ETAS[0])  # each model's runs' staleness bound, fitted below

    gpus = {name: int(c["gpus"]) for name, c in clusters.items() if c.get("gpus") is not None}

    def cm_for(
        model: str, cal: Calibration, cname: str, count: int | None = None, eta: int | None = None
    ) -> CostModel:
        s = settings[model]
        cluster = rent(s.cluster, {clusters[cname]["gpu_type"]: count or gpus[cname]})
        return CostModel(cluster, workloads[(model, cname, eta_of[model] if eta is None else eta)], cal)

    def measured(model: str, cname: str, key: str) -> float:
        return float(data["models"][model][cname][key])

    layout_of = {
        c: tuple(v["rollout_layout"]) if v.get("rollout_layout") else None for c, v in clusters.items()
    }

    given = calibration

    def kept(gpu_type: str, factors: tuple[str, ...]) -> bool:
        return not any(given.assumed(gpu_type, f) for f in factors)

    def fitted(cal: Calibration, gpu_type: str, values: Mapping[str, float], source: str) -> Calibration:
        """``cal`` with those of ``values`` that ``given`` leaves to the fit, from ``source``."""
        free = {k: v for k, v in values.items() if given.assumed(gpu_type, k)}
        return cal.with_factors(gpu_type, free, source)

    short = ", ".join(m.rsplit("-", 1)[-1] for m in models)

    # 1. The reference type: rollout and training on two machines and one.
    ref_type = clusters[ref]["gpu_type"]
    ref_pool = pool_of[ref]
    ref_gpus = gpus[ref]
    train_gpus = reference_split(cm_for(models[0], calibration, ref), ref_pool, ref_gpus)
    roll_gpus = ref_gpus - train_gpus
    if not kept(ref_type, ("train_mfu",)):

        def train_points(mfu: float, _: float = 0.0) -> list:
            cal = calibration.with_factors(ref_type, {"train_mfu": mfu})
            return [(f"{ref} train_s of {m}", train_s(cm_for(m, cal, ref), ref_pool, train_gpus,
                     settings[m].max_pp), measured(m, ref, "train_s")) for m in models]  # fmt: skip

        def train_loss(mfu: float, _: float = 0.0) -> float:
            return _log_loss((x[1], x[2]) for x in train_points(mfu))

        mfu, _ = _fit_in_range(train_loss, train_points, ref_type, ("train_mfu", "train_mfu"), unexplained)
        source = f"fit to {where}: {ref} train seconds per step of {short}"
        calibration = calibration.with_factors(ref_type, {"train_mfu": mfu}, source)
    # Each run's training seconds: a step whose admission cannot replace a batch during training waits longer.
    ref_train = {
        m: train_s(cm_for(m, calibration, ref), ref_pool, train_gpus, settings[m].max_pp) for m in models
    }
    roll = ("hbm_fraction", "decode_overhead_s")

    def roll_values(m: str, cal: Calibration) -> dict[int, float]:
        """Model m's reference rollout seconds per step at each candidate staleness bound."""
        return {eta: rollout_s(cm_for(m, cal, ref, eta=eta), ref_pool, roll_gpus, settings[m].max_pp,
                               layout_of[ref], ref_train[m])[0] for eta in ETAS}  # fmt: skip

    def nearest(values: dict[int, float], target: float) -> int:
        """The staleness bound whose value is nearest ``target`` (ties to the smaller bound)."""
        return min(ETAS, key=lambda e: (round(abs(math.log(values[e] / target)), 9), e))

    def roll_points(hbm: float, overhead: float) -> list:
        """Each model's rollout seconds at the staleness bound that fits it best: the bound is fitted per run
        jointly with the factors."""
        cal = calibration.with_factors(ref_type, {"hbm_fraction": hbm, "decode_overhead_s": overhead})
        out = []
        for m in models:
            values, target = roll_values(m, cal), measured(m, ref, "rollout_s")
            eta = nearest(values, target)
            out.append((f"{ref} rollout_s of {m} (eta {eta})", values[eta], target))
        return out

    if not kept(ref_type, roll):
        hbm, overhead = _fit_in_range(
            partial(_points_loss, roll_points), roll_points, ref_type, roll, unexplained, given
        )
        source = (
            f"fit to {where}: {ref} rollout seconds per step of {short}, each at its fitted staleness bound"
        )
        calibration = fitted(
            calibration, ref_type, {"hbm_fraction": hbm, "decode_overhead_s": overhead}, source
        )
    by_eta = {m: roll_values(m, calibration) for m in models}
    eta_of.update({m: nearest(by_eta[m], measured(m, ref, "rollout_s")) for m in models})
    misses = "; ".join(
        f"{m.rsplit('-', 1)[-1]}: " + ", ".join(
            f"eta {e} {by_eta[m][e] / measured(m, ref, 'rollout_s') - 1:+.0%}" for e in ETAS)
        for m in models
    )  # fmt: skip
    setting = MeasuredSetting(
        dict(eta_of),
        {
            "max_head_offpolicyness": f"fitted per model with the factors to the {ref} rollout seconds (the "
            f"model's miss at each bound: {misses}); the model's {ref} and other runs share it",
            "max_concurrent_rollouts": "stated: the runs leave it unset (recipes/paper/baselines.json "
            "_measured_setting), which upstream 1.0.4 replaces by consumer_batch_size",
            "update_window": "stated: AReaL pushes weights every step (Table 2 is per step)",
            "rollout_layout": "stated by the baselines file (AReaL's sglang.dNp1t1 allocation)",
            "gpus": f"{ref}: stated; others: fitted to the runs' steps where the file leaves the count open",
            "split": f"{ref}: its phases (two machines generate, one trains); others: the best whole-machine "
            "split (balanced_step)",
            "tokens_per_step": "each run's own: tokens_per_s x (weight sync + max(rollout, train))",
        },
    )
    for m in models:
        cm = cm_for(m, calibration, ref)
        points.append({"model": m, "cluster": ref, "phase": "rollout_s", "measured": measured(m, ref, "rollout_s"),
                       "model_value": rollout_s(cm, ref_pool, roll_gpus, settings[m].max_pp, layout_of[ref],
                                                ref_train[m])[0]})  # fmt: skip
        points.append({"model": m, "cluster": ref, "phase": "train_s", "measured": measured(m, ref, "train_s"),
                       "model_value": train_s(cm, ref_pool, train_gpus, settings[m].max_pp)})  # fmt: skip

    # 2. Other types: Table 1's per-GPU speeds against the fitted reference give their factors; the runs' steps
    # give the GPU count where the file leaves it open (the paper does not state its H20 count).
    price = {k: float(v) for k, v in data["prices_per_gpu_hour"].items()}
    for cname, c in clusters.items():
        if cname == ref:
            continue
        gpu_type, pool = c["gpu_type"], pool_of[cname]
        if not kept(gpu_type, ("decode_overhead_s",)):
            source = f"fit to {where}: {ref_type}'s decode overhead (the same SGLang serving stack)"
            overhead = calibration.for_gpu(ref_type).decode_overhead_s
            calibration = calibration.with_factors(gpu_type, {"decode_overhead_s": overhead}, source)
        # Table 1's $ per token ratios as per-GPU speed ratios of this type over the reference.
        cheaper = price[cname] / price[ref]
        rollout_target = {m: measured(m, cname, "rollout_cost_ratio") * cheaper for m in models}
        train_target = {m: cheaper / measured(m, cname, "train_cost_ratio") for m in models}
        steps = {m: measured(m, cname, "train_s") for m in models}

        def step_of(m: str, n: int, cal: Calibration, cname=cname, pool=pool) -> tuple[float, int]:
            return balanced_step(cm_for(m, cal, cname, n), pool, n, settings[m].max_pp, layout_of[cname])

        roll = ("hbm_fraction", "infer_mfu")
        if not kept(gpu_type, roll):
            roll_points = partial(
                _ratio_points, calibration, gpu_type, roll, per_gpu_ratio, rollout_target, settings, pool,
                ref_pool, f"Table 1 rollout tokens/s per GPU, {cname} over {ref}, of",
            )  # fmt: skip
            found = _fit_in_range(
                partial(_points_loss, roll_points), roll_points, gpu_type, roll, unexplained, given
            )
            source = f"fit to {where}: Table 1 rollout cost ratio {cname} vs {ref} of {short}"
            calibration = fitted(calibration, gpu_type, dict(zip(roll, found, strict=True)), source)
        per_machine = settings[models[0]].cluster.pool(pool).gpus_per_machine
        counts = (
            [gpus[cname]]
            if cname in gpus
            else list(range(2 * per_machine, int(c["max_gpus"]) + 1, per_machine))
        )
        if not kept(gpu_type, ("train_mfu",)):
            # Training is seen twice: Table 1's per-GPU ratio and the runs' steps (train-bound), fitted together;
            # where the count is open, each count's best fit competes.
            train_fit = partial(
                _fit_train_mfu, calibration, gpu_type, train_target, settings, pool, ref_pool, step_of, steps,
                f"Table 1 training tokens/s per GPU, {cname} over {ref}, of", f"{cname} step",
            )  # fmt: skip
            count = min(counts, key=lambda n: train_fit(n, None)) if len(counts) > 1 else counts[0]
            _, mfu = train_fit(count, unexplained)
            gpus.setdefault(cname, count)
            source = (
                f"fit to {where}: Table 1 training cost ratio {cname} vs {ref} and {cname} seconds per step "
                f"of {short}"
            )
            calibration = calibration.with_factors(gpu_type, {"train_mfu": mfu}, source)
        else:
            gpus.setdefault(cname, min(counts, key=lambda n: _log_loss(
                (step_of(m, n, calibration)[0], steps[m]) for m in models)))  # fmt: skip
        for m in models:
            points.append({"model": m, "cluster": cname, "phase": f"rollout_per_gpu_vs_{ref} (Table 1)",
                           "measured": rollout_target[m],
                           "model_value": per_gpu_ratio(calibration, settings[m], pool, ref_pool)})  # fmt: skip
            points.append({"model": m, "cluster": cname, "phase": f"train_per_gpu_vs_{ref} (Table 1)",
                           "measured": train_target[m],
                           "model_value": train_ratio(calibration, settings[m], pool, ref_pool)})  # fmt: skip
            step, train_gpus_here = step_of(m, gpus[cname], calibration)
            points.append({"model": m, "cluster": cname,
                           "phase": f"step_s (on {gpus[cname]} GPUs, train on {train_gpus_here})",
                           "measured": steps[m], "model_value": step})  # fmt: skip

    # 3. Weight updates per type: Table 2's column, the network part from the model.
    for cname, c in clusters.items():
        gpu_type, pool = c["gpu_type"], pool_of[cname]
        if kept(gpu_type, ("update_gb_per_s", "update_fixed_s")):
            continue
        fast = calibration.with_factors(gpu_type, {"update_gb_per_s": 1000.0, "update_fixed_s": 0.0})
        parts = {}
        for m in models:
            cm = cm_for(m, fast, cname)
            train_n = cm.cluster.pool(pool).gpus_per_machine
            _, shape, count = rollout_s(cm, pool, gpus[cname] - train_n, settings[m].max_pp, layout_of[cname])
            replicas = [(shape, count)] if count else [((RolloutStage(pool, 1),), gpus[cname] - train_n)]
            b = settings[m].workload.model.weight_bytes()
            net = cm.weight_sync({pool: b}, replicas).seconds - b / 1000e9
            parts[m] = (net, b)

        def sync_points(rate: float, fixed: float, parts=parts, cname=cname) -> list:
            return [(f"{cname} weight_sync_s of {m}", net + b / (rate * 1e9) + fixed,
                     measured(m, cname, "weight_sync_s")) for m, (net, b) in parts.items()]  # fmt: skip

        rate, fixed = _fit_in_range(
            partial(_sync_loss, parts, data["models"], cname), sync_points, gpu_type,
            ("update_gb_per_s", "update_fixed_s"), unexplained, given,
        )  # fmt: skip
        source = f"fit to {where}: Table 2 {cname} weight-update seconds of {short}"
        calibration = fitted(
            calibration, gpu_type, {"update_gb_per_s": rate, "update_fixed_s": fixed}, source
        )
        for label, model_value, value in sync_points(rate, fixed):
            m = label.rsplit(" of ", 1)[1]
            points.append({"model": m, "cluster": cname, "phase": "weight_sync_s", "measured": value,
                           "model_value": model_value})  # fmt: skip

    for point in points:  # whose factors each measurement fitted (the plan's interval, planner/interval.py)
        point["gpu_type"] = clusters[point["cluster"]]["gpu_type"]
    types = sorted({c["gpu_type"] for c in clusters.values()})
    factors = {t: {k: float(f"{v:.4g}") for k, v in calibration.as_dict([t])[t].items()} for t in types}
    return BaselineFit(
        calibration, factors, calibration.sources_dict(types), points, gpus, setting, unexplained
    )


def measured_setting(profile: Path = BUILTIN / "paper.json") -> dict[str, Any]:
    """The measured runs' settings a fitted profile records (``measured_setting``, :meth:`MeasuredSetting.as_dict`)."""
    data = read_format(
        profile,
        PROFILE_FORMAT,
        "hex.calibration.profile",
        "an areal-hex profile",
        "rerun areal-hex calibrate --baselines",
    )
    return data["measured_setting"]


def measured_eta(model: str, profile: Path = BUILTIN / "paper.json") -> int:
    """The staleness bound of ``model``'s measured runs that a fitted profile records."""
    return int(measured_setting(profile)["max_head_offpolicyness"][model])


def as_measured(
    setting: Setting, calibration: Calibration, data: Mapping, profile: Path = BUILTIN / "paper.json"
) -> dict[str, dict[str, Any]]:
    """Per measured cluster of ``data`` (a baselines file): the model's run as it ran (the profile's measured
    setting: its GPUs, staleness bound, layout and split; the run's tokens per step), priced by
    :func:`measured_phases` with ``calibration``, beside the measurement. Where the run's measured phases are
    equal (one waited for the other, EQUAL_PHASES) both compare with the step's max(rollout, train)."""
    found = measured_setting(profile)
    model = setting.workload.model.name
    eta = int(found["max_head_offpolicyness"][model])
    out = {}
    for cname, c in data["clusters"].items():
        run = data["models"][model][cname]
        pool = next(p.name for p in setting.cluster.pools if p.gpu_type == c["gpu_type"])
        gpus = int(found["gpus"][cname])
        workload = measured_workload(setting, float(run["tokens_per_step"]), eta)
        cm = CostModel(rent(setting.cluster, {c["gpu_type"]: gpus}), workload, calibration)
        layout = tuple(c["rollout_layout"]) if c.get("rollout_layout") else None
        if cname == data["reference"]:
            train = reference_split(cm, pool, gpus)
        else:
            train = balanced_step(cm, pool, gpus, setting.max_pp, layout)[1]
        phases = measured_phases(cm, pool, gpus, train, setting.max_pp, layout)
        if abs(run["rollout_s"] / run["train_s"] - 1) <= EQUAL_PHASES:
            phases["rollout_s"] = phases["train_s"] = max(phases["rollout_s"], phases["train_s"])
        out[cname] = {
            **phases,
            "gpus": gpus,
            "max_head_offpolicyness": eta,
            "measured": {k: float(run[k]) for k in ("rollout_s", "train_s", "weight_sync_s", "tokens_per_s")},
        }
    return out


def setting_from(recipe) -> Setting:
    """The :class:`Setting` of a loaded recipe."""
    return Setting(
        recipe.cluster,
        recipe.workload,
        min(recipe.solver.max_pp_stages, SINGLE_TYPE_MAX_PP),
        recipe.hex.workload.output_lengths,
    )
