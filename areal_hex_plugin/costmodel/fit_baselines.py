"""Calibration against measured AReaL runs: the paper's homogeneous baselines (``recipes/paper/baselines.json``).

The file holds, per model and GPU type, what AReaL measured on one GPU type (Fig. 3/4: tokens/s and seconds per
step of rollout, training and weight sync) and the tokens per step each run implies. The mixed-cluster results
are not in it and nothing here looks at them: they are what the calibrated model must predict.

Each run is put in its measured setting (:func:`measured_workload`): its own tokens per step (the recipe's
length shape, with its point mass at the cap, at the run's mean), AReaL's admission of one batch of rollouts
(upstream's default ``max_concurrent_rollouts``) and a weight update every step. Then, every factor searched
within its physical range (``calibration.RANGES``):

1. H800 (``reference``): ``hbm_fraction`` and ``decode_overhead_s`` to the three models' rollout times (the
   rollout is latency-bound: a rollout holds its admission slot until its longest sample ends), ``train_mfu``
   to their training times, on the measured cluster split the way its phases show (two 8-GPU machines generate,
   one trains);
2. every other type (H20): its runs are train-bound (their phases are equal, rollout waiting at the
   staleness bound), so they show the step, not the rollout speed. It takes the reference's
   ``decode_overhead_s`` (the same SGLang stack); ``hbm_fraction`` and ``infer_mfu`` are fitted to Table 1's
   per-GPU rollout cost ratio against the fitted reference, ``train_mfu`` to Table 1's training ratio and
   the runs' steps together (:func:`balanced_step`: the best whole-machine split of the cluster). Where the
   file leaves the GPU count open (``gpus: null``: the paper's H20 runs), each whole-machine count up to
   ``max_gpus`` is fitted and the best kept;
3. every type: ``update_gb_per_s`` and ``update_fixed_s`` to Table 2's AReaL column of that type.

A fit that needs a factor outside its range is refused (:class:`HexError` naming the measurement that pulls it
out). The planner's phases and tokens/s on the measured clusters with the fitted factors are the check
(``sim/baselines.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cache, partial
from typing import Any

from areal_hex_plugin.costmodel.calibration import RANGES, Calibration
from areal_hex_plugin.costmodel.fit import grid_search
from areal_hex_plugin.costmodel.model import CostModel, admission_room, tight_step_s
from areal_hex_plugin.costmodel.rollout import RolloutStage
from areal_hex_plugin.costmodel.single_type import SINGLE_TYPE_MAX_PP, best_rollout
from areal_hex_plugin.costmodel.train import TrainStage
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.config import OutputLengthConfig
from areal_hex_plugin.specs.rental import rent
from areal_hex_plugin.specs.workload import LengthDistribution, RLSettings, WorkloadSpec

BASELINES_FORMAT = "areal-hex-baselines/1"
# How the measured runs are planned. The paper states neither its runs' eta nor their AReaL version. Their
# rollout seconds fit, with physical factors, only runs whose every step waits for its longest sample: upstream
# 1.0.4's loop overlaps part of it at eta 1 with one batch admitted, and most of it at eta >= 2, and either way
# the fit refuses (tests/costmodel/test_paper_targets.py). So they are planned at eta 1 as runs that wait.
MEASURED_ETA = 1
WAITS_FOR_LONGEST = True
PHASES = ("rollout_s", "train_s", "weight_sync_s")
GRID = {"points": 10, "refine": 3}
# A search this far past a range's ends finds the factor a measurement would need; beyond the range it is refused
# when the best fit inside misses a measurement by more than TOLERANCE.
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
class BaselineFit:
    calibration: Calibration
    factors: dict[str, dict[str, float]]
    sources: dict[str, dict[str, str]]
    points: list[dict[str, Any]]  # each fitted measurement next to the fitted model's value
    gpus: dict[str, int] = field(default_factory=dict)  # GPUs of each measured cluster (given or fitted)


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


def areal_runtime(rl: RLSettings) -> RLSettings:
    """``rl`` as the measured AReaL runs had it: one batch of rollouts admitted at once (upstream's default
    ``max_concurrent_rollouts``), weights every step, the staleness bound ``MEASURED_ETA``, each step waiting for
    its longest sample (``WAITS_FOR_LONGEST``), no even-dispatch rule (their AReaL version and DP layout are not
    stated)."""
    return replace(
        rl,
        max_admitted=rl.consumer_batch_size,
        max_update_window=1,
        even_dispatch=False,
        max_head_offpolicyness=MEASURED_ETA,
        waits_for_longest=WAITS_FOR_LONGEST,
    )


def measured_workload(setting: Setting, tokens_per_step: float) -> WorkloadSpec:
    """The recipe's workload as a measured AReaL run had it: ``tokens_per_step`` (the mean output length that
    gives it, the recipe's length shape kept), one batch of rollouts admitted at once, weights every step, at
    the staleness bound ``MEASURED_ETA``."""
    w = setting.workload
    rl = areal_runtime(w.rl)
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
    """Seconds per step to generate a step's samples on ``gpus`` GPUs of ``pool`` filled with copies of the
    measured shape, the sequences admission lets in shared evenly, each replica rebuilding its KV cache after the
    step's weight update; with the shape and count. A run that waits for its longest sample
    (``rl.waits_for_longest``) waits for it every step; else upstream 1.0.4's loop overlaps it, and where
    admission cannot replace a batch while the trainer trains for ``train`` seconds, the step waits for what it
    lacks then (``model.tight_step_s``)."""
    stages = measured_shape(cm, pool, max_pp, layout)
    count = gpus // sum(s.tp for s in stages) if stages else 0
    if count == 0:
        return math.inf, stages or (), 0
    samples = cm.workload.rl.samples_per_step
    est = cm.rollout(stages, max_sequences=max(1, -(-cm.staleness_sequences() // count)))
    if not est.feasible:
        return math.inf, stages, count
    tokens_s = math.ceil(samples / count) * cm.workload.output_lengths.mean / est.tokens_per_s
    rl = cm.workload.rl
    if rl.waits_for_longest:
        tokens_s = max(tokens_s, est.longest_s)
    seconds = tokens_s + est.recompute_s + cm.reward_s(samples)
    batches = cm.batches_in_flight(est.concurrency * count)
    room = admission_room(rl.max_head_offpolicyness, 1, batches)
    if not rl.waits_for_longest and room < 1:
        seconds = tight_step_s(seconds, train, batches, room)
    return seconds, stages, count


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
    loss, points, gpu_type: str, names: tuple[str, str], where: str, refuse: bool = True
) -> tuple[float, float]:
    """The pair of factors ``names`` minimising ``loss``, inside their physical ranges. ``points(a, b)`` lists
    (label, model, measured) per measurement; a fit that needs a factor outside its range (the best fit inside
    misses a measurement by more than TOLERANCE) is refused, naming the measurement furthest off."""
    inside = grid_search(loss, (_bounds(names[0]), _bounds(names[1])), **GRID)
    label, model, measured = max(points(*inside), key=lambda x: abs(math.log(x[1] / x[2])))
    if not refuse or abs(model / measured - 1) <= TOLERANCE:
        return inside
    wide = grid_search(loss, (_bounds(names[0], WIDEN), _bounds(names[1], WIDEN)), **GRID)
    out = [(n, v) for n, v in zip(names, wide, strict=True) if v not in RANGES[n]]
    if out:
        name, value = out[0]
        raise HexError(
            "baselines",
            f"{gpu_type} {name} would fit at {value:.3g}, outside its physical range {RANGES[name]} "
            f"({RANGES[name].why}); {label} pulls it out: {measured:g} measured, {model:.4g} at the best fit inside",
            f"check that measurement in {where} and the setting it was taken in",
        )
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
    where,
    n: int,
    refuse: bool,
) -> tuple[float, float]:
    """The ``train_mfu`` of ``gpu_type`` fitting Table 1's training ratio and the runs' steps on ``n`` GPUs
    together, inside its range (refused outside it when ``refuse``): its loss and value."""

    def points(mfu: float, _: float = 0.0) -> list:
        """Table 1's training ratio points and each run's step at ``train_mfu`` = ``mfu``."""
        cal = calibration.with_factors(gpu_type, {"train_mfu": mfu})
        ratios = _ratio_points(
            calibration, gpu_type, ("train_mfu",), train_ratio, target, settings, pool, ref_pool, label, mfu
        )
        runs = [(f"{step_label} on {n} GPUs of {m}", step_of(m, n=n, cal=cal)[0], steps[m]) for m in steps]
        return ratios + runs

    loss = cache(partial(_points_loss, points))
    mfu, _ = _fit_in_range(lambda a, _: loss(a), points, gpu_type, ("train_mfu", "train_mfu"), where, refuse)
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
    model names to the recipe setting. Factors ``calibration`` already sources from a profile are kept."""
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
    workloads = {
        (m, c): measured_workload(settings[m], float(data["models"][m][c]["tokens_per_step"]))
        for m in models
        for c in clusters
    }

    gpus = {name: int(c["gpus"]) for name, c in clusters.items() if c.get("gpus") is not None}

    def cm_for(model: str, cal: Calibration, cname: str, count: int | None = None) -> CostModel:
        s = settings[model]
        cluster = rent(s.cluster, {clusters[cname]["gpu_type"]: count or gpus[cname]})
        return CostModel(cluster, workloads[(model, cname)], cal)

    def measured(model: str, cname: str, key: str) -> float:
        return float(data["models"][model][cname][key])

    layout_of = {
        c: tuple(v["rollout_layout"]) if v.get("rollout_layout") else None for c, v in clusters.items()
    }

    def kept(gpu_type: str, factors: tuple[str, ...]) -> bool:
        return all(calibration.source(gpu_type, f).startswith("profile") for f in factors)

    short = ", ".join(m.rsplit("-", 1)[-1] for m in models)

    # 1. The reference type: rollout and training on two machines and one.
    ref_type = clusters[ref]["gpu_type"]
    ref_pool = pool_of[ref]
    gpm = settings[models[0]].cluster.pool(ref_pool).gpus_per_machine
    ref_gpus = gpus[ref]
    train_gpus = gpm * max(1, (ref_gpus // gpm) // 3)
    roll_gpus = ref_gpus - train_gpus
    if not kept(ref_type, ("train_mfu",)):

        def train_points(mfu: float, _: float = 0.0) -> list:
            cal = calibration.with_factors(ref_type, {"train_mfu": mfu})
            return [(f"{ref} train_s of {m}", train_s(cm_for(m, cal, ref), ref_pool, train_gpus,
                     settings[m].max_pp), measured(m, ref, "train_s")) for m in models]  # fmt: skip

        def train_loss(mfu: float, _: float = 0.0) -> float:
            return _log_loss((x[1], x[2]) for x in train_points(mfu))

        mfu, _ = _fit_in_range(train_loss, train_points, ref_type, ("train_mfu", "train_mfu"), where)
        source = f"fit to {where}: {ref} train seconds per step of {short}"
        calibration = calibration.with_factors(ref_type, {"train_mfu": mfu}, source)
    # Each run's training seconds: a step whose admission cannot replace a batch during training waits longer.
    ref_train = {
        m: train_s(cm_for(m, calibration, ref), ref_pool, train_gpus, settings[m].max_pp) for m in models
    }
    if not kept(ref_type, ("hbm_fraction", "decode_overhead_s")):

        def roll_points(hbm: float, overhead: float) -> list:
            cal = calibration.with_factors(ref_type, {"hbm_fraction": hbm, "decode_overhead_s": overhead})
            return [(f"{ref} rollout_s of {m}", rollout_s(cm_for(m, cal, ref), ref_pool, roll_gpus,
                     settings[m].max_pp, layout_of[ref], ref_train[m])[0], measured(m, ref, "rollout_s"))
                    for m in models]  # fmt: skip

        def roll_loss(hbm: float, overhead: float) -> float:
            return _log_loss((x[1], x[2]) for x in roll_points(hbm, overhead))

        hbm, overhead = _fit_in_range(
            roll_loss, roll_points, ref_type, ("hbm_fraction", "decode_overhead_s"), where
        )
        source = f"fit to {where}: {ref} rollout seconds per step of {short}"
        calibration = calibration.with_factors(
            ref_type, {"hbm_fraction": hbm, "decode_overhead_s": overhead}, source
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
            fitted = _fit_in_range(partial(_points_loss, roll_points), roll_points, gpu_type, roll, where)
            source = f"fit to {where}: Table 1 rollout cost ratio {cname} vs {ref} of {short}"
            calibration = calibration.with_factors(gpu_type, dict(zip(roll, fitted, strict=True)), source)
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
                f"Table 1 training tokens/s per GPU, {cname} over {ref}, of", f"{cname} step", where,
            )  # fmt: skip
            count = min(counts, key=lambda n: train_fit(n, refuse=False)) if len(counts) > 1 else counts[0]
            _, mfu = train_fit(count, refuse=True)
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
            ("update_gb_per_s", "update_fixed_s"), where,
        )  # fmt: skip
        source = f"fit to {where}: Table 2 {cname} weight-update seconds of {short}"
        calibration = calibration.with_factors(
            gpu_type, {"update_gb_per_s": rate, "update_fixed_s": fixed}, source
        )
        for label, model_value, value in sync_points(rate, fixed):
            m = label.rsplit(" of ", 1)[1]
            points.append({"model": m, "cluster": cname, "phase": "weight_sync_s", "measured": value,
                           "model_value": model_value})  # fmt: skip

    types = sorted({c["gpu_type"] for c in clusters.values()})
    factors = {t: {k: float(f"{v:.4g}") for k, v in calibration.as_dict([t])[t].items()} for t in types}
    return BaselineFit(calibration, factors, calibration.sources_dict(types), points, gpus)


def setting_from(recipe) -> Setting:
    """The :class:`Setting` of a loaded recipe."""
    return Setting(
        recipe.cluster,
        recipe.workload,
        min(recipe.solver.max_pp_stages, SINGLE_TYPE_MAX_PP),
        recipe.hex.workload.output_lengths,
    )
