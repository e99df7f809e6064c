"""Calibration against measured AReaL runs: the paper's homogeneous baselines (``recipes/paper/baselines.json``).

The file holds, per model and GPU type, what AReaL measured on one GPU type (Fig. 3/4: seconds per step of
rollout, training and weight sync) and Table 1's per-GPU cost ratios. The mixed-cluster results are not in it and
nothing here looks at them: they are what the calibrated model must predict.

Per GPU type the fit puts the cost model in the measured setting and fits:

1. H800 (``reference``): ``hbm_fraction`` and ``infer_mfu`` to the three models' rollout times, ``train_mfu``
   and ``train_fixed_s`` to their training times (least squares in log time), on the measured cluster split the way
   its phases show: the 24 GPUs are three 8-GPU machines, rollout is the longer phase, so two machines generate
   and one trains (the other split would make rollout at least twice as long);
2. every other type (H20): AReaL on 68 H20 is train-bound (its two phases are equal because rollout waits at
   the staleness bound), so its phases give the step time but do not separate rollout from training speed.
   Table 1 gives the rollout speed: per GPU, H20 generates ``1.85 / 5.28 * ratio`` times as fast as the H800, so
   ``hbm_fraction`` and ``infer_mfu`` are fitted to that against the fitted H800 (best single-type replica per
   GPU). ``train_mfu`` and ``train_fixed_s`` are fitted so that the best whole-machine split of the measured
   GPUs has the measured step (:func:`balanced_step`, least squares in log time over the models). Table 1's
   training ratio is not a target (the paper's H20 phases and its Table 1 disagree there);
3. every type: ``update_gb_per_s`` and ``update_fixed_s`` to Table 2's AReaL column of that type (three sizes,
   two factors), with the network part of each update taken from the model.

The planner's phases on the measured clusters with the fitted factors are the check (``sim/baselines.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from areal_hex_plugin.costmodel.calibration import FACTORS, Calibration
from areal_hex_plugin.costmodel.fit import grid_search
from areal_hex_plugin.costmodel.model import CostModel
from areal_hex_plugin.costmodel.rollout import RolloutStage
from areal_hex_plugin.costmodel.single_type import SINGLE_TYPE_MAX_PP, best_rollout
from areal_hex_plugin.costmodel.train import TrainStage
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.rental import rent
from areal_hex_plugin.specs.workload import WorkloadSpec

BASELINES_FORMAT = "areal-hex-baselines/1"
PHASES = ("rollout_s", "train_s", "weight_sync_s")
# Coarse log grid then three finer rounds; fixed seconds are searched as a fraction of FIXED_SCALE.
GRID = {"points": 12, "low": 1e-3, "refine": 4}
FIXED_SCALE = 500.0
RATE_SCALE = 100.0


@dataclass(frozen=True)
class Setting:
    """One measured model: its recipe's cluster (every pool the file names) and workload."""

    cluster: Cluster
    workload: WorkloadSpec
    max_pp: int


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
    """The baselines file, checked: format, reference type, clusters and per-model phases."""
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
    for model, per in models.items():
        for name in clusters:
            for phase in PHASES:
                _num(per.get(name, {}), phase, f"models.{model}.{name}")
            if name != data["reference"]:
                for key in ("rollout_cost_ratio", "train_cost_ratio"):
                    _num(per.get(name, {}), key, f"models.{model}.{name}")
    return data


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


def rollout_s(cm: CostModel, pool: str, gpus: int, max_pp: int) -> tuple[float, tuple, int]:
    """Seconds per step to generate a step's samples on ``gpus`` GPUs of ``pool`` filled with the best
    per-GPU replica, each rebuilding its KV cache after the step's weight update; with the shape and count."""
    stages, est = best_rollout(cm, cm.cluster.pool(pool), max_pp)
    if stages is None or not est.feasible:
        return math.inf, (), 0
    count = gpus // est.n_gpus
    if count == 0:
        return math.inf, stages, 0
    samples = cm.workload.rl.samples_per_step
    seconds = (
        math.ceil(samples / count) * cm.workload.output_lengths.mean / est.tokens_per_s + est.recompute_s
    )
    return seconds + cm.reward_s(samples), stages, count


def _per_gpu(cm: CostModel, pool: str, max_pp: int) -> float:
    """Generated tokens/s per GPU of ``pool``'s best single-type replica."""
    p = cm.cluster.pool(pool)
    _, roll = best_rollout(cm, p, max_pp)
    if not (roll and roll.feasible):
        raise HexError("baselines", f"{p.gpu_type} fits no rollout replica of this model", "check the recipe")
    return roll.tokens_per_s / roll.n_gpus


def _log_loss(pairs) -> float:
    return sum(math.log(model / measured) ** 2 for model, measured in pairs)


def _sync_loss(parts: Mapping, measured: Mapping, cluster: str, rate: float, fixed: float) -> float:
    return _log_loss(
        (net + size / (rate * RATE_SCALE * 1e9) + fixed * FIXED_SCALE, measured[m][cluster]["weight_sync_s"])
        for m, (net, size) in parts.items()
    )


def _fit_rollout_ratio(
    calibration: Calibration,
    settings: Mapping[str, Setting],
    models: list[str],
    pool: str,
    gpu_type: str,
    targets: Mapping[str, float],
    source: str,
) -> Calibration:
    """``gpu_type``'s inference factors fitted to per-GPU rollout throughput ``targets``."""

    def loss(hbm: float, mfu: float) -> float:
        cal = calibration.with_factors(gpu_type, {"hbm_fraction": hbm, "infer_mfu": mfu})
        return _log_loss(
            (_per_gpu(CostModel(settings[m].cluster, settings[m].workload, cal), pool, settings[m].max_pp),
             targets[m]) for m in models
        )  # fmt: skip

    hbm, mfu = grid_search(loss, **GRID)
    return calibration.with_factors(gpu_type, {"hbm_fraction": hbm, "infer_mfu": mfu}, source)


def _step_loss(
    calibration, settings, models, cname, gpu_type, pool, gpus, steps, cm_for, mfu, fixed
) -> float:
    cal = calibration.with_factors(gpu_type, {"train_mfu": mfu, "train_fixed_s": fixed * FIXED_SCALE})
    return _log_loss(
        (balanced_step(cm_for(m, cal, cname), pool, gpus, settings[m].max_pp)[0], steps[m]) for m in models
    )


def balanced_step(cm: CostModel, pool: str, gpus: int, max_pp: int) -> tuple[float, int]:
    """The shortest step max(train, rollout) over splits of ``gpus`` GPUs of ``pool`` that train on whole
    machines, and the GPUs that train."""
    per_machine = cm.cluster.pool(pool).gpus_per_machine
    best = (math.inf, 0)
    for train_gpus in range(per_machine, gpus, per_machine):
        step = max(train_s(cm, pool, train_gpus, max_pp), rollout_s(cm, pool, gpus - train_gpus, max_pp)[0])
        best = min(best, (step, train_gpus))
    return best


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

    def cm_for(model: str, cal: Calibration, cname: str) -> CostModel:
        s = settings[model]
        cluster = rent(s.cluster, {clusters[cname]["gpu_type"]: int(clusters[cname]["gpus"])})
        return CostModel(cluster, s.workload, cal)

    def measured(model: str, cname: str, key: str) -> float:
        return float(data["models"][model][cname][key])

    def kept(gpu_type: str, factors: tuple[str, ...]) -> bool:
        return all(calibration.source(gpu_type, f).startswith("profile") for f in factors)

    # 1. The reference type: rollout and training on two machines and one.
    ref_type = clusters[ref]["gpu_type"]
    ref_pool = pool_of[ref]
    gpm = settings[models[0]].cluster.pool(ref_pool).gpus_per_machine
    ref_gpus = int(clusters[ref]["gpus"])
    train_gpus = gpm * max(1, (ref_gpus // gpm) // 3)
    roll_gpus = ref_gpus - train_gpus
    source = f"fit to {where}: {ref} rollout and train seconds per step of {', '.join(models)}"
    if not kept(ref_type, ("hbm_fraction", "infer_mfu")):

        def roll_loss(hbm: float, mfu: float) -> float:
            cal = calibration.with_factors(ref_type, {"hbm_fraction": hbm, "infer_mfu": mfu})
            return _log_loss(
                (rollout_s(cm_for(m, cal, ref), ref_pool, roll_gpus, settings[m].max_pp)[0],
                 measured(m, ref, "rollout_s")) for m in models
            )  # fmt: skip

        hbm, mfu = grid_search(roll_loss, **GRID)
        calibration = calibration.with_factors(ref_type, {"hbm_fraction": hbm, "infer_mfu": mfu}, source)
    if not kept(ref_type, ("train_mfu", "train_fixed_s")):

        def train_loss(mfu: float, fixed: float) -> float:
            cal = calibration.with_factors(ref_type, {"train_mfu": mfu, "train_fixed_s": fixed * FIXED_SCALE})
            return _log_loss(
                (train_s(cm_for(m, cal, ref), ref_pool, train_gpus, settings[m].max_pp),
                 measured(m, ref, "train_s")) for m in models
            )  # fmt: skip

        mfu, fixed = grid_search(train_loss, **GRID)
        calibration = calibration.with_factors(
            ref_type, {"train_mfu": mfu, "train_fixed_s": fixed * FIXED_SCALE}, source
        )
    for m in models:
        cm = cm_for(m, calibration, ref)
        points.append({"model": m, "cluster": ref, "phase": "rollout_s", "measured": measured(m, ref, "rollout_s"),
                       "model_value": rollout_s(cm, ref_pool, roll_gpus, settings[m].max_pp)[0]})  # fmt: skip
        points.append({"model": m, "cluster": ref, "phase": "train_s", "measured": measured(m, ref, "train_s"),
                       "model_value": train_s(cm, ref_pool, train_gpus, settings[m].max_pp)})  # fmt: skip

    # 2. Other types: rollout from Table 1's per-GPU ratio against the fitted reference, training from the
    # type's measured step (its phases are equal: training-bound, rollout waiting at the staleness bound).
    price = {c: float(data["prices_per_gpu_hour"][c]) for c in clusters}
    for cname, c in clusters.items():
        if cname == ref:
            continue
        gpu_type, pool, gpus = c["gpu_type"], pool_of[cname], int(c["gpus"])
        targets = {}
        for m in models:
            ref_roll = _per_gpu(CostModel(settings[m].cluster, settings[m].workload, calibration), ref_pool,
                                settings[m].max_pp)  # fmt: skip
            targets[m] = ref_roll * price[cname] / price[ref] * data["models"][m][cname]["rollout_cost_ratio"]
        kept_here = {f for f in FACTORS if calibration.source(gpu_type, f).startswith("profile")}
        if not {"hbm_fraction", "infer_mfu"} <= kept_here:
            source = (
                f"fit to {where}: Table 1 per-GPU rollout cost ratio {cname} vs {ref} of {', '.join(models)}"
            )
            calibration = _fit_rollout_ratio(calibration, settings, models, pool, gpu_type, targets, source)
        steps = {m: measured(m, cname, "train_s") for m in models}
        if not {"train_mfu", "train_fixed_s"} <= kept_here:
            loss = partial(
                _step_loss, calibration, settings, models, cname, gpu_type, pool, gpus, steps, cm_for
            )
            mfu, fixed = grid_search(loss, **GRID)
            source = f"fit to {where}: {cname} seconds per step (train-bound) of {', '.join(models)}"
            calibration = calibration.with_factors(
                gpu_type, {"train_mfu": mfu, "train_fixed_s": fixed * FIXED_SCALE}, source
            )
        for m in models:
            cm = CostModel(settings[m].cluster, settings[m].workload, calibration)
            points.append({"model": m, "cluster": cname, "phase": "rollout_tokens_per_s_per_gpu",
                           "measured": targets[m], "model_value": _per_gpu(cm, pool, settings[m].max_pp)})  # fmt: skip
            step, train_gpus = balanced_step(cm_for(m, calibration, cname), pool, gpus, settings[m].max_pp)
            points.append({"model": m, "cluster": cname, "phase": f"step_s (train on {train_gpus} GPUs)",
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
            _, shape, count = rollout_s(cm, pool, gpus - train_n, settings[m].max_pp)
            replicas = [(shape, count)] if count else [((RolloutStage(pool, 1),), gpus - train_n)]
            b = settings[m].workload.model.weight_bytes()
            net = cm.weight_sync({pool: b}, replicas).seconds - b / 1000e9
            parts[m] = (net, b)

        rate, fixed = grid_search(partial(_sync_loss, parts, data["models"], cname), **GRID)
        source = f"fit to {where}: Table 2 {cname} weight-update seconds of {', '.join(models)}"
        calibration = calibration.with_factors(
            gpu_type, {"update_gb_per_s": rate * RATE_SCALE, "update_fixed_s": fixed * FIXED_SCALE}, source
        )
        eff = calibration.for_gpu(gpu_type)
        for m in models:
            net, b = parts[m]
            points.append({"model": m, "cluster": cname, "phase": "weight_sync_s",
                           "measured": measured(m, cname, "weight_sync_s"),
                           "model_value": net + b / (eff.update_gb_per_s * 1e9) + eff.update_fixed_s})  # fmt: skip

    types = sorted({c["gpu_type"] for c in clusters.values()})
    factors = {t: {k: float(f"{v:.4g}") for k, v in calibration.as_dict([t])[t].items()} for t in types}
    return BaselineFit(calibration, factors, calibration.sources_dict(types), points)


def setting_from(recipe) -> Setting:
    """The :class:`Setting` of a loaded recipe."""
    return Setting(recipe.cluster, recipe.workload, min(recipe.solver.max_pp_stages, SINGLE_TYPE_MAX_PP))
