"""How sure a prediction is: the interval on a plan's tokens/s and step time, and the band the objective ties in.

Each factor of a GPU type (``costmodel/calibration.py``) has an interval:

* a factor still at the built-in assumption (``Calibration.assumed``): its whole physical range (``RANGES``);
  nothing measured narrows it;
* a fitted or given factor: its value times exp(+-r), r the fit's residual spread for the type
  (``Calibration.residual``: rms of ln(model / measured) over the measurements its factors were fitted to, as
  the profile records them, ``calibration.read_profile_residuals``; the measurements the fit could not explain
  are among them and widen it); none where r is 0.

A plan's interval (:func:`plan_interval`) combines, per side and in quadrature on ln(tokens/s) (independent
sources, first order): the residual spread r (the largest of the plan's GPU types: how far the fitted model misses
the measurements it was fitted to), and each assumed factor of the plan's types moved alone to each end of its
range, the plan held (``planner/sensitivity.py``: its layouts, replica counts and window kept, re-scored without
a re-solve). Fitted factors add nothing beside r: their spread is the residual itself. The step time is tokens per
step over tokens/s, so its interval is the reciprocal one.

The objective's tie band (``hex.objective.pick: cheapest_within_interval``, :func:`tie_band`): plans whose
tokens/s are within max(TIE_FLOOR, r) of the fastest are not told apart by the model, r the largest residual
spread among the cluster's types, and the cheapest of them is the plan (the budget is a ceiling). A band has an
edge, so the plan then steps down to the cheapest plan within TIE_FLOOR of its own tokens/s where it costs more
than (1 + CEILING_SLACK) times that one, and again from there until it does not (:func:`ceiling_pick`; each step
keeps 98% of the tokens/s for under 1/1.05 of the price, and prices strictly fall, so it ends): the plan costs at
most 5% above any plan scored within 2% of its tokens/s. The assumed factors' ranges do not widen the band: they move every plan on a type together, and where a factor inside its interval
would pick another plan, :func:`interval_flips` reports the factor, the value and the measurement that decides it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TypeVar

from areal_hex_plugin.costmodel import Calibration, CostModel
from areal_hex_plugin.costmodel.calibration import RANGES
from areal_hex_plugin.plan import Flip
from areal_hex_plugin.planner.sensitivity import Held, Input, Rules, changed, flips, model

# The tie band's floor: differences below 2% are inside any cost model's noise.
TIE_FLOOR = 0.02
# The plan steps down to a plan within TIE_FLOOR of its tokens/s where it costs more than (1 + this) times that.
CEILING_SLACK = 0.05
T = TypeVar("T")
# What decides each factor, for a flip's report ({recipe} and {gpu_type} filled in).
_PROFILE = "areal-hex profile {recipe} --gpu-type {gpu_type} --json {gpu_type}.json"
_RUNS = (
    "time a run's {what} on {gpu_type} and fit it: areal-hex calibrate --baselines RUNS.json --json OUT.json"
)
MEASURE = {
    "train_mfu": _PROFILE,
    "infer_mfu": _PROFILE,
    "hbm_fraction": _PROFILE,
    "link_efficiency": _PROFILE,
    "update_gb_per_s": _RUNS.replace("{what}", "weight updates"),
    "update_fixed_s": _RUNS.replace("{what}", "weight updates"),
    "decode_overhead_s": _RUNS.replace("{what}", "rollout steps"),
}


def factor_interval(calibration: Calibration, gpu_type: str, factor: str) -> tuple[float, float] | None:
    """The interval of one factor of ``gpu_type`` (see the module's docstring); None where it has none."""
    r = RANGES[factor]
    if calibration.assumed(gpu_type, factor):
        return r.low, r.high
    spread = calibration.residual(gpu_type)
    if spread <= 0:
        return None
    value = getattr(calibration.for_gpu(gpu_type), factor)
    return max(r.low, value * math.exp(-spread)), min(r.high, value * math.exp(spread))


def _factor_inputs(calibration: Calibration, gpu_types: Iterable[str], assumed_only: bool) -> list[tuple]:
    """(Input, interval) of each factor of ``gpu_types`` with an interval (``assumed_only``: the assumed ones)."""
    out = []
    for gpu_type in sorted(set(gpu_types)):
        eff = calibration.for_gpu(gpu_type)
        for factor in RANGES:
            ends = factor_interval(calibration, gpu_type, factor)
            if ends is None or (assumed_only and not calibration.assumed(gpu_type, factor)):
                continue
            out.append((Input(gpu_type, factor, getattr(eff, factor)), ends))
    return out


def residual(calibration: Calibration, gpu_types: Iterable[str]) -> float:
    """The largest residual spread among ``gpu_types`` (0: none fitted)."""
    return max((calibration.residual(t) for t in gpu_types), default=0.0)


def tie_band(calibration: Calibration, gpu_types: Iterable[str]) -> float:
    """The share of the fastest's tokens/s within which plans tie: max(TIE_FLOOR, the residual spread)."""
    return max(TIE_FLOOR, residual(calibration, gpu_types))


def ceiling_pick(points: list[T], rate: Callable[[T], float], cost: Callable[[T], float], band: float) -> T:
    """The budget as a ceiling (see the module's docstring): the cheapest of ``points`` within ``band`` of the
    fastest's tokens/s (``rate``; the fastest on a cost tie), then down while a plan within TIE_FLOOR of its
    tokens/s costs CEILING_SLACK less."""

    def cheapest(floor: float) -> T:
        return min((e for e in points if rate(e) >= floor * (1 - 1e-12)), key=lambda e: (cost(e), -rate(e)))

    chosen = cheapest((1 - band) * max(map(rate, points)))
    while True:
        below = cheapest((1 - TIE_FLOOR) * rate(chosen))
        if cost(below) * (1 + CEILING_SLACK) >= cost(chosen):
            return chosen
        chosen = below


def plan_interval(
    base: CostModel, rules: Rules, held: Held, gpu_types: Iterable[str], rate: float
) -> tuple[float, float]:
    """(low, high) tokens/s of the plan ``held`` (predicted ``rate``) on ``base``, using ``gpu_types``."""
    types = sorted(set(gpu_types))
    spread = residual(base.calibration, types)
    down, up = spread**2, spread**2
    at = held.tokens_per_s(base, rules)
    for inp, ends in _factor_inputs(base.calibration, types, assumed_only=True):
        for end in ends:
            w, c, _ = changed(inp, end / inp.value - 1, base.workload, base.calibration)
            q = held.tokens_per_s(model(base, w, c), rules)
            if q <= 0 or at <= 0:  # the layout no longer runs there: no lower bound
                down = math.inf
                continue
            d = math.log(q / at)
            down, up = (down + d * d, up) if d < 0 else (down, up + d * d)
    return rate * math.exp(-math.sqrt(down)), rate * math.exp(math.sqrt(up))


def interval_flips(
    base: CostModel,
    rules: Rules,
    candidates: list,
    pick: Callable[[Callable[[object], float]], object],
    chosen,
) -> list[Flip]:
    """Per factor with an interval (every GPU type of the cluster) and each of its ends: the plan ``pick`` takes
    among ``candidates`` re-scored held there, where it is another (``sensitivity.flips``)."""
    moves = [
        (inp, end / inp.value - 1)
        for inp, ends in _factor_inputs(base.calibration, base.cluster.gpu_types, assumed_only=False)
        for end in ends
        if inp.value > 0 and not math.isclose(end, inp.value)
    ]
    return flips(base, rules, candidates, pick, chosen, moves=moves)


def describe_interval_flip(flip: Flip, calibration: Calibration, recipe: str, chosen_cost: float) -> str:
    """A flip inside a factor's interval as a plan warning, with the measurement that decides it."""
    low, high = factor_interval(calibration, flip.group, flip.input) or (flip.value, flip.value)
    kind = (
        "assumed: its physical range"
        if calibration.assumed(flip.group, flip.input)
        else "fitted, +- residual"
    )
    train, rollout = (
        " + ".join(f"{n} {t}" for t, n in sorted(g.items())) for g in (flip.train, flip.rollout)
    )
    how = MEASURE[flip.input].format(recipe=recipe, gpu_type=flip.group)
    return (
        f"{train} training and {rollout} generating (${flip.cost_per_hour:,.2f}/h, {flip.tokens_per_s:,.0f} "
        f"tokens/s there, this plan ${chosen_cost:,.2f}/h {flip.chosen_tokens_per_s:,.0f}) would win if "
        f"{flip.input} of {flip.group} were {flip.value:.4g} (inside its interval {low:.4g} to {high:.4g}, "
        f"{kind}); measure it: {how}"
    )
