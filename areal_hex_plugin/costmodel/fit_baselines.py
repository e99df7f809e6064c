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
2. every other type (H20): its memory system and serving stack are the reference's (the same Hopper die and
   HBM3 kernels), so it takes the reference's ``hbm_fraction`` and ``decode_overhead_s``; its ``infer_mfu`` and
   ``train_mfu`` are fitted so that the best whole-machine split of the measured GPUs has the measured step
   (:func:`balanced_step`: its phases are equal, the shorter one waiting);
3. every type: ``update_gb_per_s`` and ``update_fixed_s`` to Table 2's AReaL column of that type.

A fit that needs a factor outside its range is refused (:class:`HexError` naming the measurement that pulls it
out). The planner's phases and tokens/s on the measured clusters with the fitted factors are the check
(``sim/baselines.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from areal_hex_plugin.costmodel.calibration import RANGES, Calibration
from areal_hex_plugin.costmodel.fit import grid_search
from areal_hex_plugin.costmodel.model import CostModel
from areal_hex_plugin.costmodel.rollout import RolloutStage
from areal_hex_plugin.costmodel.single_type import SINGLE_TYPE_MAX_PP, best_rollout
from areal_hex_plugin.costmodel.train import TrainStage
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.config import OutputLengthConfig
from areal_hex_plugin.specs.rental import rent
from areal_hex_plugin.specs.workload import LengthDistribution, WorkloadSpec

BASELINES_FORMAT = "areal-hex-baselines/1"
PHASES = ("rollout_s", "train_s", "weight_sync_s")
GRID = {"points": 10, "refine": 3}
# A search this far past a range's ends finds the factor a measurement would need; beyond the range it is refused
# when the best fit inside misses a measurement by more than TOLERANCE.
WIDEN = 4.0
TOLERANCE = 0.15
# Another type's factors: its memory system and serving stack start as the reference's (SHARED); ROUNDS are fitted to
# its own steps one pair after the other.
SHARED = ("hbm_fraction", "decode_overhead_s")
ROUNDS = (("infer_mfu", "train_mfu"), ("hbm_fraction", "decode_overhead_s"))


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
        _num(c, "gpus", f"clusters.{name}")
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


def measured_workload(setting: Setting, tokens_per_step: float) -> WorkloadSpec:
    """The recipe's workload as a measured AReaL run had it: ``tokens_per_step`` (the mean output length that
    gives it, the recipe's length shape kept), one batch of rollouts admitted at once, weights every step."""
    w = setting.workload
    rl = replace(w.rl, max_admitted=w.rl.consumer_batch_size, max_update_window=1)
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
    cm: CostModel, pool: str, gpus: int, max_pp: int, layout: tuple[int, int] | None = None
) -> tuple[float, tuple, int]:
    """Seconds per step to generate a step's samples on ``gpus`` GPUs of ``pool`` filled with copies of the
    measured shape, the sequences admission lets in shared evenly, each replica waiting for the step's longest
    sample and rebuilding its KV cache after the step's weight update; with the shape and count."""
    stages = measured_shape(cm, pool, max_pp, layout)
    count = gpus // sum(s.tp for s in stages) if stages else 0
    if count == 0:
        return math.inf, stages or (), 0
    samples = cm.workload.rl.samples_per_step
    est = cm.rollout(stages, max_sequences=max(1, -(-cm.staleness_sequences() // count)))
    if not est.feasible:
        return math.inf, stages, count
    tokens_s = math.ceil(samples / count) * cm.workload.output_lengths.mean / est.tokens_per_s
    seconds = max(tokens_s, est.longest_s) + est.recompute_s
    return seconds + cm.reward_s(samples), stages, count


def balanced_step(
    cm: CostModel, pool: str, gpus: int, max_pp: int, layout: tuple[int, int] | None = None
) -> tuple[float, int]:
    """The shortest step max(train, rollout) over splits of ``gpus`` GPUs of ``pool`` that train on whole
    machines, and the GPUs that train."""
    per_machine = cm.cluster.pool(pool).gpus_per_machine
    best = (math.inf, 0)
    for train_gpus in range(per_machine, gpus, per_machine):
        roll = rollout_s(cm, pool, gpus - train_gpus, max_pp, layout)[0]
        step = max(train_s(cm, pool, train_gpus, max_pp), roll)
        best = min(best, (step, train_gpus))
    return best


def _per_gpu(cm: CostModel, pool: str, max_pp: int) -> float:
    """Generated tokens/s per GPU of ``pool``'s best single-type replica at a full batch (0 if none fits)."""
    _, roll = best_rollout(cm, cm.cluster.pool(pool), max_pp)
    return roll.tokens_per_s / roll.n_gpus if roll is not None and roll.feasible else 0.0


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


def _step_points(calibration, names, gpu_type, cname, models, steps, step_s, a: float, b: float) -> list:
    """(label, model, measured) of each model's step on ``cname`` with ``gpu_type``'s factors ``names`` at (a, b);
    ``step_s(model, calibration)`` is the model's step."""
    cal = calibration.with_factors(gpu_type, dict(zip(names, (a, b), strict=True)))
    return [(f"{cname} step of {m}", step_s(m, cal), steps[m]) for m in models]


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

    def cm_for(model: str, cal: Calibration, cname: str) -> CostModel:
        s = settings[model]
        cluster = rent(s.cluster, {clusters[cname]["gpu_type"]: int(clusters[cname]["gpus"])})
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
    ref_gpus = int(clusters[ref]["gpus"])
    train_gpus = gpm * max(1, (ref_gpus // gpm) // 3)
    roll_gpus = ref_gpus - train_gpus
    if not kept(ref_type, ("hbm_fraction", "decode_overhead_s")):

        def roll_points(hbm: float, overhead: float) -> list:
            cal = calibration.with_factors(ref_type, {"hbm_fraction": hbm, "decode_overhead_s": overhead})
            return [(f"{ref} rollout_s of {m}", rollout_s(cm_for(m, cal, ref), ref_pool, roll_gpus,
                     settings[m].max_pp, layout_of[ref])[0], measured(m, ref, "rollout_s")) for m in models]  # fmt: skip

        def roll_loss(hbm: float, overhead: float) -> float:
            return _log_loss((x[1], x[2]) for x in roll_points(hbm, overhead))

        hbm, overhead = _fit_in_range(
            roll_loss, roll_points, ref_type, ("hbm_fraction", "decode_overhead_s"), where
        )
        source = f"fit to {where}: {ref} rollout seconds per step of {short}"
        calibration = calibration.with_factors(
            ref_type, {"hbm_fraction": hbm, "decode_overhead_s": overhead}, source
        )
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
    for m in models:
        cm = cm_for(m, calibration, ref)
        points.append({"model": m, "cluster": ref, "phase": "rollout_s", "measured": measured(m, ref, "rollout_s"),
                       "model_value": rollout_s(cm, ref_pool, roll_gpus, settings[m].max_pp, layout_of[ref])[0]})  # fmt: skip
        points.append({"model": m, "cluster": ref, "phase": "train_s", "measured": measured(m, ref, "train_s"),
                       "model_value": train_s(cm, ref_pool, train_gpus, settings[m].max_pp)})  # fmt: skip

    # 2. Other types: the reference's memory system, their own compute, to the measured step.
    for cname, c in clusters.items():
        if cname == ref:
            continue
        gpu_type, pool, gpus = c["gpu_type"], pool_of[cname], int(c["gpus"])
        if not kept(gpu_type, SHARED):
            source = f"{ref_type}'s (the same Hopper HBM kernels and serving stack), fit to {where}"
            calibration = calibration.with_factors(
                gpu_type, {k: getattr(calibration.for_gpu(ref_type), k) for k in SHARED}, source
            )
        steps = {m: measured(m, cname, "train_s") for m in models}
        for i, names in enumerate(ROUNDS):
            if kept(gpu_type, names):
                continue
            step_points = partial(
                _step_points, calibration, names, gpu_type, cname, models, steps,
                lambda m, cal, cname=cname, pool=pool, gpus=gpus: balanced_step(
                    cm_for(m, cal, cname), pool, gpus, settings[m].max_pp, layout_of[cname])[0],
            )  # fmt: skip

            def step_loss(a: float, b: float, points=step_points) -> float:
                return _log_loss((x[1], x[2]) for x in points(a, b))

            last = i == len(ROUNDS) - 1
            fitted = _fit_in_range(step_loss, step_points, gpu_type, names, where, refuse=last)
            source = f"fit to {where}: {cname} seconds per step of {short}"
            calibration = calibration.with_factors(gpu_type, dict(zip(names, fitted, strict=True)), source)
        price = data.get("prices_per_gpu_hour", {})
        for m in models:
            ratio = data["models"][m][cname].get("rollout_cost_ratio")
            if ratio and cname in price and ref in price:
                # Table 1 (a check, not fitted): per-GPU rollout speed vs the reference at a full batch.
                per_gpu = [
                    _per_gpu(
                        CostModel(settings[m].cluster, settings[m].workload, calibration),
                        p,
                        settings[m].max_pp,
                    )
                    for p in (pool, ref_pool)
                ]
                points.append({"model": m, "cluster": cname, "phase": f"rollout_per_gpu_vs_{ref} (Table 1, check)",
                               "measured": ratio * price[cname] / price[ref], "model_value": per_gpu[0] / per_gpu[1]})  # fmt: skip
        for m in models:
            step, train_gpus_here = balanced_step(
                cm_for(m, calibration, cname), pool, gpus, settings[m].max_pp, layout_of[cname]
            )
            points.append({"model": m, "cluster": cname, "phase": f"step_s (train on {train_gpus_here} GPUs)",
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
            gpus = int(c["gpus"])
            train_n = cm.cluster.pool(pool).gpus_per_machine
            _, shape, count = rollout_s(cm, pool, gpus - train_n, settings[m].max_pp, layout_of[cname])
            replicas = [(shape, count)] if count else [((RolloutStage(pool, 1),), gpus - train_n)]
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
    return BaselineFit(calibration, factors, calibration.sources_dict(types), points)


def setting_from(recipe) -> Setting:
    """The :class:`Setting` of a loaded recipe."""
    return Setting(
        recipe.cluster,
        recipe.workload,
        min(recipe.solver.max_pp_stages, SINGLE_TYPE_MAX_PP),
        recipe.hex.workload.output_lengths,
    )
