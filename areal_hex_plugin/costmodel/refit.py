"""Online refit: the factors of the GPU types a run uses, fitted to what the run measures, the recipe's calibration
(the shipped profile) as the prior.

The live run calls it in its refit worker process (``planner/refit_worker.py``); every call is pure (no shared
state, nothing written):

    window = MeasurementWindow(warmup=WARMUP_STEPS, steps=WINDOW_STEPS)
    # every training step, from the run's own figures:
    window.add(StepSample(servers=(ServerSample("h800", tp=2, pp=1, running=96, tokens_per_s=2_400.0), ...),
                          train_s=155.6, sync_s=2.1,  # None on a step without a weight update
                          pool_sync_s=(("h800", 2.1),)))  # where known: each receiving pool's view of it
    # every N steps: the medians in the trainer's thread, the fit in another
    fit = refit(cm, layout, window.measured(), run="trial-1", prior=recipe.calibration)
    # cm: the model the run believes now (the recipe's, or with the last refit's calibration)
    fit.calibration    # cm's with the refit factors, each sourced "refit from run trial-1: steps a-b, ..."
    fit.points         # each measured median beside the model before and after the refit
    write_json(path, fit.profile())  # a hex.calibration.profile (hex_profile.json), read back by read_profile

:class:`RunLayout` is what ran (the training stages, the weight update's replicas); ``planner/refit_replan.py``
builds it from the running plan (``plan_layout``) and decides whether the refit model re-plans (``decide``).
Measurements are per step and per server: its decode tokens/s at its running requests (SGLang's
``gen_throughput`` and ``num_running_reqs``), the train step's seconds and a weight update's seconds. The window drops the first ``warmup`` steps and keeps the
last ``steps``; the fit reads the medians (per server shape: running requests and tokens/s; the train step; the
steps with an update).

The fit is ``calibrate``'s (``costmodel/fit.py``: :func:`grid_search` in log error, inside every factor's
physical range), in the same order as :func:`fit.fit_profile`, each group regularised toward the prior (a maximum
a posteriori fit: the measurements' log error over ``MEASURED_SPREAD``, each factor's log distance from the prior
over ``PRIOR_SPREAD``), so a few noisy steps move a factor a little, not to its range end:

1. per GPU type that generates: ``hbm_fraction`` and ``infer_mfu`` to its servers' tokens/s at their running
   requests (``decode_overhead_s`` held, as ``fit_profile`` holds it);
2. ``train_mfu`` of the training types (one multiplier on all of them) to the step's training seconds; where no
   value in its range comes within a factor 2 (``DIVERGED``) of them, the phase keeps the running model's factors
   and its point says so (``Refit.held``: it leaves the residual, and the other phases' refits stand);
3. ``update_gb_per_s`` and ``update_fixed_s`` of each type the update involves (a multiplier pair per type: one
   pair for all of them first, then, where the run times each receiving pool's update, one type after another,
   twice round) to the update's seconds.

Between 1 and 2, a figure the recipe declares in its own ``hex.gpu_catalog`` (a belief, unlike the shipped,
sourced specs) is fitted where the factor that scales it cannot explain the run inside its range
(:func:`fit_declared`): the type's ``hbm_fraction`` at its range end and its servers still missed by more than
``DECLARED_MISS``. Then ``hbm_tb_per_s`` (within ``DECLARED_RANGE`` times the declared figure either way,
regularised toward the prior's as a factor is) and ``infer_mfu`` are fitted with ``hbm_fraction`` back at the
prior's, and the figure goes into the calibration (:meth:`Calibration.with_figures`), sourced like a factor.
A catalog that is right leaves every factor inside its range, so its figures never move.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from areal_hex_plugin.costmodel.calibration import RANGES, Calibration
from areal_hex_plugin.costmodel.fit import grid_search
from areal_hex_plugin.costmodel.model import CostModel
from areal_hex_plugin.costmodel.rollout import RolloutStage
from areal_hex_plugin.costmodel.train import TrainStage
from areal_hex_plugin.specs.config import GpuTypeConfig
from areal_hex_plugin.specs.typed import meta_of

# Steps left out at the start of a run (or after a change of layout): the pipeline fills, the caches warm.
WARMUP_STEPS = 2
# Steps the medians are taken over.
WINDOW_STEPS = 10
# A step's median is known to about 5% (log error); a factor is believed within about 50% of the prior's value.
MEASURED_SPREAD = 0.05
# Standard errors of a median in the refit prediction's uncertainty (Measured.uncertainty): about a 95% band.
UNCERTAINTY_Z = 2.0
PRIOR_SPREAD = math.log(1.5)
GRID = {"points": 12, "refine": 4}

ROLLOUT = ("hbm_fraction", "infer_mfu")
UPDATE = ("update_gb_per_s", "update_fixed_s")
# A refit whose model still misses the measurements by more than a factor 2 (rms of ln(model/measured)) is not
# trusted: the measurements say something the model cannot express (a server stalled, a wrong layout).
DIVERGED = math.log(2)
# A declared catalog figure is fitted within this factor of the recipe's either way, where its type's servers
# are still missed by more than DECLARED_MISS (rms log error) with hbm_fraction at its range end.
DECLARED_RANGE = 10.0
DECLARED_MISS = 2 * MEASURED_SPREAD
DECLARED_SOURCE = "hex.gpu_catalog"  # the source of a figure a recipe declares (specs/catalog.py)
FIGURE_HIGH = meta_of(GpuTypeConfig, "hbm_tb_per_s")[
    "range"
].high  # what hex.gpu_catalog accepts, so a profile reads back


@dataclass(frozen=True)
class ServerSample:
    """One rollout server at one step: its shape, running requests and decode tokens/s."""

    pool: str
    tp: int
    pp: int
    running: float
    tokens_per_s: float

    @property
    def shape(self) -> tuple[str, int, int]:
        return self.pool, self.tp, self.pp


@dataclass(frozen=True)
class StepSample:
    """What one training step measured; ``sync_s`` None on a step without a weight update. ``pool_sync_s``, where
    the run times it: each receiving pool's own update (from the trainer's send to its servers' resume), which
    tells apart the types a whole update's time mixes (its fixed cost is the slowest type's)."""

    servers: tuple[ServerSample, ...] = ()
    train_s: float | None = None
    sync_s: float | None = None
    pool_sync_s: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Measured:
    """Medians over a window of steps: per server shape (pool, tp, pp), running requests and tokens/s."""

    servers: dict[tuple[str, int, int], tuple[float, float]]
    train_s: float | None
    sync_s: dict[str, float]  # per receiving pool, "" the whole update
    steps: int
    first_step: int  # the window's first step (counted from 1)
    # The refit prediction's relative uncertainty from the window's own scatter (see MeasurementWindow.measured).
    uncertainty: float = 0.0


def _usable(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


class MeasurementWindow:
    """The last ``steps`` steps after the first ``warmup``; :meth:`measured` gives their medians."""

    def __init__(self, warmup: int = WARMUP_STEPS, steps: int = WINDOW_STEPS) -> None:
        self.warmup = warmup
        self.step = 0  # steps added so far
        self.layout_start = 0  # the step the current layout started after
        self.kept: deque[tuple[int, StepSample]] = deque(maxlen=steps)

    def add(self, sample: StepSample) -> None:
        self.step += 1
        if self.step - self.layout_start > self.warmup:
            self.kept.append((self.step, sample))

    def restart(self) -> None:
        """A new layout: its steps warm up again and the old layout's are dropped."""
        self.layout_start = self.step
        self.kept.clear()

    @property
    def samples(self) -> list[StepSample]:
        return [sample for _, sample in self.kept]

    def measured(self) -> Measured:
        """The medians (a frozen snapshot: take it in the thread that adds, fit in another), and how well the
        window knows them: ``uncertainty`` is ``UNCERTAINTY_Z`` standard errors of the least certain median the
        fit reads (a server shape's tokens/s and running requests together: the fit pairs their medians; the
        train step; an update), from the steps' scatter (:func:`median_standard_error`). A change the refit
        model finds must gain more than that: on a few noisy steps the medians move by as much."""
        servers: dict[tuple[str, int, int], list[ServerSample]] = {}
        for step in self.samples:
            for s in step.servers:
                if _usable(s.tokens_per_s) and s.running >= 1:
                    servers.setdefault(s.shape, []).append(s)
        train = [s.train_s for s in self.samples if _usable(s.train_s)]
        sync: dict[str, list[float]] = {}
        for step in self.samples:
            for pool, seconds in (("", step.sync_s), *step.pool_sync_s):
                if _usable(seconds):
                    sync.setdefault(pool, []).append(seconds)
        errors = [
            math.hypot(
                median_standard_error([s.tokens_per_s for s in v]),
                median_standard_error([s.running for s in v]),
            )
            for v in servers.values()
        ]
        errors += [median_standard_error(v) for v in (train, *sync.values())]
        return Measured(
            servers={
                k: (statistics.median(s.running for s in v), statistics.median(s.tokens_per_s for s in v))
                for k, v in sorted(servers.items())
            },
            train_s=statistics.median(train) if train else None,
            sync_s={pool: statistics.median(v) for pool, v in sorted(sync.items())},
            steps=len(self.kept),
            first_step=self.kept[0][0] if self.kept else self.step + 1,
            uncertainty=UNCERTAINTY_Z * max(errors, default=0.0),
        )


def median_standard_error(values: Sequence[float]) -> float:
    """The relative standard error of the median of ``values`` (positive): their logs' spread, 1.4826 times their
    median absolute deviation (a standard deviation a few wild steps do not move), times sqrt(pi / 2) / sqrt(n),
    the median's error for n draws; 0 for fewer than two."""
    if len(values) < 2:
        return 0.0
    logs = [math.log(v) for v in values]
    centre = statistics.median(logs)
    spread = 1.4826 * statistics.median(abs(x - centre) for x in logs)
    return spread * math.sqrt(math.pi / 2 / len(values))


@dataclass(frozen=True)
class RunLayout:
    """What ran: the training stages, and the weight update's receivers (replicas off the training machines and
    the pools whose replicas share a machine with training), its strategy."""

    train: tuple[TrainStage, ...]
    replicas: tuple[tuple[tuple[RolloutStage, ...], int], ...]
    strategy: str
    colocated: tuple[str, ...] = ()

    def train_s(self, cm: CostModel) -> float:
        return cm.train(self.train).step_time_s

    def sync_s(self, cm: CostModel, pool: str = "", senders: dict[str, float] | None = None) -> float:
        """One update's seconds (to ``pool``'s servers only, where named)."""
        replicas = [(s, n) for s, n in self.replicas if not pool or s[0].pool == pool]
        colocated = [p for p in self.colocated if not pool or p == pool]
        senders = senders or cm.senders(self.train)
        return cm.weight_sync(senders, replicas, self.strategy, colocated).seconds


def server_tokens_per_s(cm: CostModel, shape: tuple[str, int, int], running: float) -> float:
    """The model's decode tokens/s of one server of ``shape`` with ``running`` sequences in flight, the step
    time linear between whole counts (as the simulator's step table reads it): a median of running requests
    may fall between two."""
    pool, tp, pp = shape
    stages = tuple(RolloutStage(pool, tp) for _ in range(pp))
    low = max(1, math.floor(running))
    points = []
    for n in sorted({low, max(low, math.ceil(running))}):
        est = cm.rollout(stages, max_sequences=n)
        if not est.feasible:
            return 0.0
        points.append((est.concurrency, est.step_time_s))
    (n0, s0), (n1, s1) = points[0], points[-1]
    if n1 == n0:
        return n0 / s0
    n = min(max(running, n0), n1)
    return n / (s0 + (s1 - s0) * (n - n0) / (n1 - n0))


@dataclass(frozen=True)
class Refit:
    calibration: Calibration
    factors: dict[str, dict[str, float]]  # per GPU type refit: the factors in effect
    points: list[dict[str, Any]]  # each median measured beside the model before and after the refit
    gpu_types: tuple[str, ...]

    @property
    def figures(self) -> dict[str, dict[str, float]]:
        """Per GPU type refit: the catalog figures the calibration gives it in place of the catalog's."""
        out: dict[str, dict[str, float]] = {}
        for t, f, v in self.calibration.figures:
            if t in self.gpu_types:
                out.setdefault(t, {})[f] = v
        return out

    @property
    def rms_log_error(self) -> float:
        """Root-mean-square of ln(refit model / measured) over the points it fitted (0.1 is about 10%)."""
        return _rms(p for p in self.points if "held" not in p)

    @property
    def held(self) -> list[str]:
        """The measurements no factor in range explains, each with why its phase keeps the running factors."""
        return [f"{p['what']}: {p['held']}" for p in self.points if "held" in p]

    def profile(self) -> dict[str, Any]:
        """The refit as a profile JSON (``hex.calibration.profile``): factors, sources, and the residuals."""
        fit = {t: {"rms_log_error": round(self.rms_log_error, 4)} for t in self.gpu_types}
        return {**self.calibration.profile(list(self.gpu_types)), "points": self.points, "fit": fit}


def _loss(pairs: Iterable[tuple[float, float]], moves: Iterable[float]) -> float:
    """MAP loss: measured log errors over MEASURED_SPREAD, log moves from the prior over PRIOR_SPREAD."""
    fit = sum((math.log(m / x) / MEASURED_SPREAD) ** 2 if m > 0 else 1e9 for m, x in pairs)
    return fit + sum((math.log(k) / PRIOR_SPREAD) ** 2 for k in moves)


def _scale_bounds(prior: Calibration, types: Sequence[str], factor: str) -> tuple[float, float]:
    """Multipliers of ``factor`` that keep every type's value inside its physical range."""
    values = [getattr(prior.for_gpu(t), factor) for t in types]
    r = RANGES[factor]
    return max(r.low / v for v in values), min(r.high / v for v in values)


def _inside(factor: str, value: float) -> float:
    """``value`` within ``factor``'s range (the grid search may step a rounding error past an end)."""
    return min(max(value, RANGES[factor].low), RANGES[factor].high)


def _scaled(
    cal: Calibration, prior: Calibration, types: Sequence[str], scales: dict[str, float]
) -> Calibration:
    """``cal`` with ``types``' factors the prior's times ``scales`` (factor -> multiplier)."""
    for t in types:
        eff = prior.for_gpu(t)
        cal = cal.with_factors(t, {f: _inside(f, getattr(eff, f) * k) for f, k in scales.items()})
    return cal


def refit(
    cm: CostModel, layout: RunLayout, measured: Measured, run: str, prior: Calibration | None = None
) -> Refit:
    """The factors of the GPU types in ``layout`` fitted to ``measured`` (see the module doc). ``cm``'s
    calibration is the model the run believes now (every factor not fitted keeps its value: a type the layout
    no longer measures keeps an earlier refit); ``prior`` (default: the same) is what the fit is regularised
    toward, the shipped profile in a live run."""
    cal = cm.calibration
    prior = prior or cal
    where = f"refit from run {run}: steps {measured.first_step}-{measured.first_step + measured.steps - 1}"
    points: list[dict[str, Any]] = []
    pool_type = {p.name: p.gpu_type for p in cm.cluster.pools}
    refit_types: set[str] = set()

    # 1. Rollout, per GPU type.
    by_type: dict[str, list[tuple[tuple[str, int, int], float, float]]] = {}
    for shape, (running, rate) in measured.servers.items():
        by_type.setdefault(pool_type[shape[0]], []).append((shape, running, rate))
    for gpu_type, servers in sorted(by_type.items()):
        base = prior.for_gpu(gpu_type)

        def model(hbm: float, mfu: float, gpu_type=gpu_type, servers=servers, cal=cal) -> list[float]:
            trial = cm.with_calibration(cal.with_factors(gpu_type, {"hbm_fraction": hbm, "infer_mfu": mfu}))
            return [server_tokens_per_s(trial, shape, running) for shape, running, _ in servers]

        def loss(hbm: float, mfu: float, base=base, servers=servers, model=model) -> float:
            pairs = zip(model(hbm, mfu), (rate for _, _, rate in servers), strict=True)
            return _loss(pairs, (hbm / base.hbm_fraction, mfu / base.infer_mfu))

        bounds = tuple((RANGES[f].low, RANGES[f].high) for f in ROLLOUT)
        fitted = grid_search(loss, bounds, **GRID, start=(base.hbm_fraction, base.infer_mfu))
        hbm, mfu = (_inside(f, v) for f, v in zip(ROLLOUT, fitted, strict=True))
        now = cal.for_gpu(gpu_type)
        before = model(now.hbm_fraction, now.infer_mfu)
        after = model(hbm, mfu)
        shapes = ", ".join(f"{p} tp{tp}pp{pp}" for (p, tp, pp), _, _ in servers)
        cal = cal.with_factors(
            gpu_type, {"hbm_fraction": hbm, "infer_mfu": mfu}, f"{where}, decode tokens/s of {shapes}"
        )
        refit_types.add(gpu_type)
        for (shape, running, rate), b, a in zip(servers, before, after, strict=True):
            points.append({"what": "rollout_tokens_per_s", "gpu_type": gpu_type,
                           "server": f"{shape[0]} tp{shape[1]}pp{shape[2]}", "running": running,
                           "measured": rate, "before": b, "model": a})  # fmt: skip

    cal = fit_declared(cm, cal, prior, by_type, points, where)

    # 2. Training: one multiplier on the training types' train_mfu.
    train_types = sorted({pool_type[s.pool] for s in layout.train})
    if _usable(measured.train_s) and train_types:
        fitted = cal

        @cache
        def train_loss(k: float) -> float:
            trial = cm.with_calibration(_scaled(fitted, prior, train_types, {"train_mfu": k}))
            return _loss([(layout.train_s(trial), measured.train_s)], [k])

        low, high = _scale_bounds(prior, train_types, "train_mfu")
        k, _ = grid_search(lambda a, _: train_loss(a), ((low, high), (1.0, 1.0)), **GRID, start=(1.0, 1.0))
        before = layout.train_s(cm.with_calibration(cal))
        trial = _scaled(cal, prior, train_types, {"train_mfu": k})
        after = layout.train_s(cm.with_calibration(trial))
        point = {"what": "train_s", "gpu_type": ", ".join(train_types), "measured": measured.train_s,
                 "before": before, "model": after}  # fmt: skip
        if abs(math.log(after / measured.train_s)) > DIVERGED:
            # No train_mfu in range comes within a factor 2 (a trainer of another speed than the catalog's): the
            # phase keeps the running model's train factors, and the other phases' refits stand.
            point["model"] = before
            point["held"] = (
                f"no train_mfu in its range explains {measured.train_s:.3g} s (the model gives {after:.3g} s at "
                f"best); the running train factors stay"
            )
        else:
            cal = trial
            for t in train_types:
                cal = cal.with_factors(
                    t, {"train_mfu": cal.for_gpu(t).train_mfu}, f"{where}, train step seconds"
                )
            refit_types.update(train_types)
        points.append(point)

    # 3. Weight update: a multiplier on each type's update factors, all together, then one type after another.
    sync_types = sorted(
        {*train_types, *(pool_type[s.pool] for stages, _ in layout.replicas for s in stages)}
        | {pool_type[p] for p in layout.colocated}
    )
    if measured.sync_s and layout.train:
        senders = cm.senders(layout.train)
        fitted = cal
        scales = {t: (1.0, 1.0) for t in sync_types}

        def with_scales(scales: dict[str, tuple[float, float]]) -> Calibration:
            out = fitted
            for t, pair in scales.items():
                out = _scaled(out, prior, [t], dict(zip(UPDATE, pair, strict=True)))
            return out

        def model(trial: Calibration) -> list[float]:
            trial_cm = cm.with_calibration(trial)
            return [layout.sync_s(trial_cm, pool, senders) for pool in measured.sync_s]

        # First one pair for every type together (the whole update pays the slowest type's fixed cost, so no
        # type alone can move it), then, where the run times a pool's own update, each type's own from there. The
        # whole update alone cannot tell the types apart: fitted one by one from it, a type whose fixed cost it
        # does not pay falls back to the prior's, and the refit would believe one pool's update costlier than
        # another's on no evidence.
        apart = bool(measured.sync_s.keys() - {""})
        for group in [sync_types, *([t] for t in [*sync_types, *sync_types] if apart)]:

            def sync_loss(rate: float, fixed: float, group=group, scales=scales) -> float:
                trial = {**scales, **dict.fromkeys(group, (rate, fixed))}
                pairs = zip(model(with_scales(trial)), measured.sync_s.values(), strict=True)
                return _loss(pairs, [k for pair in trial.values() for k in pair])

            bounds = tuple(_scale_bounds(prior, group, f) for f in UPDATE)
            scales = {
                **scales,
                **dict.fromkeys(group, grid_search(sync_loss, bounds, **GRID, start=scales[group[0]])),
            }
        before = model(cal)
        cal = with_scales(scales)
        for t in sync_types:
            eff = cal.for_gpu(t)
            cal = cal.with_factors(t, {f: getattr(eff, f) for f in UPDATE}, f"{where}, weight update seconds")
        refit_types.update(sync_types)
        for (pool, seconds), b, a in zip(measured.sync_s.items(), before, model(cal), strict=True):
            points.append({"what": "sync_s", "pool": pool or "all", "measured": seconds, "before": b,
                           "model": a})  # fmt: skip

    types = tuple(sorted(refit_types))
    return Refit(cal, cal.as_dict(list(types)), points, types)


def diverged(fit: Refit) -> str | None:
    """Why ``fit`` is not to be trusted (a factor out of range, or the model still missing the measurements by
    more than ``DIVERGED``, naming the measurement it misses most), or None."""
    for t, factors in fit.factors.items():
        for f, v in factors.items():
            r = RANGES.get(f)
            if not math.isfinite(v) or (r is not None and not r.low <= v <= r.high):
                return f"{t} {f} = {v} is outside its range"
    if math.isfinite(fit.rms_log_error) and fit.rms_log_error <= DIVERGED:
        return None
    worst = max(fit.points, key=lambda p: abs(math.log(p["model"] / p["measured"])), default=None)
    where = "" if worst is None else (
        f"; worst {worst['what']} of {worst.get('server') or worst.get('pool') or worst.get('gpu_type')}: "
        f"measured {worst['measured']:.4g}, the refit model {worst['model']:.4g}"
    )  # fmt: skip
    return f"the refit model still misses the measurements by {fit.rms_log_error:.2f} (rms log error){where}"


def _rms(points: Iterable[dict[str, Any]], key: str = "model") -> float:
    errors = [math.log(p[key] / p["measured"]) ** 2 if p[key] > 0 else math.inf for p in points]
    return math.sqrt(sum(errors) / len(errors)) if errors else 0.0


def fit_declared(
    cm: CostModel,
    cal: Calibration,
    prior: Calibration,
    by_type: dict[str, list[tuple[tuple[str, int, int], float, float]]],
    points: list[dict[str, Any]],
    where: str,
) -> Calibration:
    """``cal`` with the declared ``hbm_tb_per_s`` of each type in ``by_type`` (its servers' shapes, medians of
    running requests and tokens/s) fitted where the rollout fit cannot reach them inside ``hbm_fraction``'s range
    (see the module doc); the type's ``points`` then give the model with the figure. A fit that misses them no
    less is dropped."""
    figure, r = "hbm_tb_per_s", RANGES["hbm_fraction"]
    for gpu_type, servers in sorted(by_type.items()):
        spec = next(p.gpu for p in cm.catalog_cluster.pools if p.gpu_type == gpu_type)
        own = [p for p in points if p["what"] == "rollout_tokens_per_s" and p["gpu_type"] == gpu_type]
        hbm, miss = cal.for_gpu(gpu_type).hbm_fraction, _rms(own)
        at_end = hbm >= r.high * 0.99 or hbm <= r.low * 1.01
        if not spec.source(figure).startswith(DECLARED_SOURCE) or not at_end or miss <= DECLARED_MISS:
            continue
        declared = getattr(spec, figure)
        believed = prior.figure(gpu_type, figure) or declared
        base = prior.for_gpu(gpu_type)

        def model(
            value: float, mfu: float, gpu_type=gpu_type, servers=servers, base=base, cal=cal
        ) -> list[float]:
            trial = cal.with_figures(gpu_type, {figure: value}, "trial").with_factors(
                gpu_type, {"hbm_fraction": base.hbm_fraction, "infer_mfu": mfu}
            )
            trial_cm = cm.with_calibration(trial)
            return [server_tokens_per_s(trial_cm, shape, running) for shape, running, _ in servers]

        def loss(
            value: float, mfu: float, servers=servers, model=model, believed=believed, base=base
        ) -> float:
            pairs = zip(model(value, mfu), (rate for _, _, rate in servers), strict=True)
            return _loss(pairs, (value / believed, mfu / base.infer_mfu))

        bounds = (
            (declared / DECLARED_RANGE, min(declared * DECLARED_RANGE, FIGURE_HIGH)),
            (RANGES["infer_mfu"].low, RANGES["infer_mfu"].high),
        )
        value, mfu = grid_search(loss, bounds, **GRID, start=(believed, base.infer_mfu))
        mfu = _inside("infer_mfu", mfu)
        after = model(value, mfu)
        if _rms([{**p, "model": a} for p, a in zip(own, after, strict=True)]) >= miss:
            continue
        shapes = ", ".join(f"{p} tp{tp}pp{pp}" for (p, tp, pp), _, _ in servers)
        source = f"{where}, decode tokens/s of {shapes} (hbm_fraction at its range end: {figure} refit)"
        cal = cal.with_figures(gpu_type, {figure: value}, source)
        cal = cal.with_factors(gpu_type, {"hbm_fraction": base.hbm_fraction, "infer_mfu": mfu}, source)
        for p, a in zip(own, after, strict=True):
            p["model"] = a
    return cal
