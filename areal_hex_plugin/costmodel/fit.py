"""Calibration from measurements: the efficiency factors under which the cost model reproduces what a GPU did.

``areal-hex profile`` times a real SGLang engine (prefill, and decode steps at several batch sizes) and a real
FSDP training step on one machine of a GPU type. Here the cost model is put in that same setting and the factors
are fitted so that its times match, in this order:

1. ``link_efficiency``: the measured all-reduce bus bandwidth over the machine's GPU link (when several GPUs ran).
2. ``hbm_fraction`` and ``infer_mfu``: least squares in log time over every decode step and prefill the engine ran
   (small batches pin the bandwidth, prefill and large batches the compute). A prefill call also pays the
   engine's fixed cost per request batch, which the model has no term for: it is the intercept of prefill time
   over batch size, taken off before fitting and reported as ``prefill_call_s``.
3. ``train_mfu``: bisection until the model's log-prob forward plus PPO update takes the measured time.

The factors are therefore in the model's own terms (its FLOP counts, its overheads), which is what the scheduler
needs; ``ProfileFit.points`` shows how closely the fitted model tracks each measurement.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from areal_hex_plugin.costmodel.calibration import GENERIC, RANGES, Calibration
from areal_hex_plugin.costmodel.rollout import RolloutStage, batch_timings
from areal_hex_plugin.costmodel.train import TrainStage, estimate_train
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.cluster import Cluster, Pool
from areal_hex_plugin.specs.models import ModelShape
from areal_hex_plugin.specs.workload import LengthDistribution, RLSettings, WorkloadSpec

MEASUREMENTS_FORMAT = "areal-hex-measurements/2"
PROBE = "probe"


@dataclass(frozen=True)
class ProfileFit:
    factors: dict[str, float]
    points: list[dict[str, Any]]  # each measured time next to the fitted model's
    prefill_call_s: float = 0.0  # the engine's fixed cost per prefill call, outside the model

    @property
    def rms_log_error(self) -> float:
        """Root-mean-square of ln(model / measured) over the points (0.1 is about 10%)."""
        errors = [math.log(p["model_s"] / p["measured_s"]) ** 2 for p in self.points]
        return math.sqrt(sum(errors) / len(errors))


def probe_setting(
    pool: Pool,
    model: ModelShape,
    gpus: int,
    prompt_tokens: int,
    output_tokens: int,
    sequences: int,
    minibatches: int = 1,
) -> tuple[Cluster, WorkloadSpec]:
    """One machine of ``pool`` with ``gpus`` GPUs, running ``sequences`` sequences of fixed lengths."""
    machine = replace(
        pool, name=PROBE, gpus_per_machine=max(gpus, pool.gpus_per_machine), machines=1, hosts=()
    )
    rl = RLSettings(
        batch_size=sequences,
        n_samples=1,
        max_new_tokens=output_tokens,
        max_head_offpolicyness=1,
        max_concurrent_rollouts=None,
        consumer_batch_size=sequences,
        ppo_n_minibatches=minibatches,
        recompute_logprob=True,  # the measured step runs one log-prob forward besides the update
        use_decoupled_loss=False,
        ref_model=False,
        gradient_checkpointing=True,  # areal-hex profile trains with the recipe's actor, which checkpoints
    )
    lengths = LengthDistribution((output_tokens,), "profile")
    workload = WorkloadSpec(model, rl, prompt_tokens, lengths, 0.0, 1)
    return Cluster((machine,), pool.inter_machine_gb_per_s), workload


def _number(data: Mapping, key: str, where: str) -> float:
    """``data[key]`` as a positive finite number, or a HexError naming ``where.key``."""
    value = data.get(key) if isinstance(data, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise HexError(
            "measurements", f"{where}.{key} is missing or not a number", "re-run areal-hex profile"
        )
    if value <= 0:
        raise HexError(
            "measurements", f"{where}.{key} must be positive, got {value}", "re-run areal-hex profile"
        )
    return float(value)


def _fit_link(pool: Pool, train: Mapping) -> dict[str, float]:
    if train.get("allreduce_bus_gb_per_s") is None or _number(train, "gpus", "train") < 2:
        return {}
    bus = _number(train, "allreduce_bus_gb_per_s", "train")
    return {"link_efficiency": min(1.0, bus / pool.intra_machine_gb_per_s)}


def _decode_points(decode: Mapping) -> list[tuple[int, float, float]]:
    points = decode.get("points") if isinstance(decode, Mapping) else None
    if not isinstance(points, list) or not points:
        raise HexError("measurements", "decode.points is missing or empty", "re-run areal-hex profile")
    out = []
    for i, point in enumerate(points):
        batch = _number(point, "batch", f"decode.points[{i}]")
        out.append((int(batch), _number(point, "prefill_s", f"decode.points[{i}]"),
                    _number(point, "step_s", f"decode.points[{i}]")))  # fmt: skip
    return out


def _call_cost(points: list[tuple[int, float, float]]) -> float:
    """Intercept of prefill seconds over batch size, within [0, fastest call).

    Least squares on relative error (weights 1/t^2): timing noise scales with the time, so the large batches
    must not set the intercept that only the small ones can show.
    """
    weights = [(b, t, 1 / t**2) for b, t, _ in points]
    s, sb, sbb = (sum(w * b**k for b, _, w in weights) for k in (0, 1, 2))
    st, sbt = sum(w * t for _, t, w in weights), sum(w * b * t for b, t, w in weights)
    det = s * sbb - sb**2
    if det <= 0:  # one batch size: no line to draw
        return 0.0
    intercept = (sbb * st - sb * sbt) / det
    return min(max(0.0, intercept), 0.9 * min(t for _, t, _ in points))


def grid_search(
    loss,
    bounds: tuple[tuple[float, float], tuple[float, float]],
    points: int = 24,
    refine: int = 8,
    start: tuple[float, float] | None = None,
) -> tuple[float, float]:
    """The pair of factors within ``bounds`` ((low, high) of each) minimising ``loss(a, b)``: a coarse log grid
    (and ``start``, where given), then finer ones around the best point (the losses fitted here are smooth with
    one basin). A fit regularised toward a prior starts there: where the measurements agree with it the loss
    has a long flat valley, and the grid's points in it land a little off the prior, not on it."""
    ratios = [(high / low) ** (1 / (points - 1)) for low, high in bounds]
    grids = [[low * r**i for i in range(points)] for (low, _), r in zip(bounds, ratios, strict=True)]
    candidates = [(a, b) for a in grids[0] for b in grids[1]] + ([start] if start else [])
    best = min(candidates, key=lambda ab: loss(*ab))

    def inside(ab: tuple[float, float]) -> bool:
        return all(
            low * (1 - 1e-9) <= x <= high * (1 + 1e-9) for x, (low, high) in zip(ab, bounds, strict=True)
        )

    for _ in range(3):
        pairs = (
            (best[0] * ratios[0] ** (i / refine), best[1] * ratios[1] ** (j / refine))
            for i in range(-refine, refine + 1)
            for j in range(-refine, refine + 1)
        )
        best = min((ab for ab in pairs if inside(ab)), key=lambda ab: loss(*ab))
        ratios = [r ** (1 / refine) for r in ratios]
    return best


def _bounds(factor: str) -> tuple[float, float]:
    r = RANGES[factor]
    return r.low, r.high


def bisect_factor(too_slow, low: float, high: float) -> float:
    """The factor in [low, high] where ``too_slow(factor)`` turns False (the model gets fast enough);
    ``high`` when even it is too slow."""
    if too_slow(high):
        return high
    for _ in range(40):
        if high - low < 1e-5:
            break
        mid = (low + high) / 2
        low, high = (mid, high) if too_slow(mid) else (low, mid)
    return (low + high) / 2


def _fit_rollout(
    pool: Pool, model: ModelShape, decode: Mapping, calibration: Calibration
) -> tuple[dict[str, float], list[dict[str, Any]], float]:
    points = _decode_points(decode)
    call_s = _call_cost(points)
    prompt = int(_number(decode, "prompt_tokens", "decode"))
    generated = int(_number(decode, "decode_tokens", "decode"))
    tp = int(_number(decode, "tp", "decode"))
    cluster, workload = probe_setting(pool, model, tp, prompt, generated, max(b for b, _, _ in points))
    stages = (RolloutStage(PROBE, tp),)
    ctx = prompt + generated / 2  # mean context over the timed decode steps

    def model_times(hbm: float, mfu: float) -> list[tuple[float, float]]:
        cal = calibration.with_factors(pool.gpu_type, {"hbm_fraction": hbm, "infer_mfu": mfu})
        try:
            return batch_timings(cluster, workload, cal, stages, [b for b, _, _ in points], ctx)
        except ValueError as exc:
            raise HexError(
                "measurements", f"decode.tp={tp}: {exc}", "measure a TP the machine can hold"
            ) from None

    def loss(hbm: float, mfu: float) -> float:
        return sum(
            math.log(p / (mp - call_s)) ** 2 + math.log(s / ms) ** 2
            for (p, s), (_, mp, ms) in zip(model_times(hbm, mfu), points, strict=True)
        )

    hbm, mfu = grid_search(loss, (_bounds("hbm_fraction"), _bounds("infer_mfu")))
    fitted = []
    for (prefill, step), (batch, m_prefill, m_step) in zip(model_times(hbm, mfu), points, strict=True):
        fitted.append(
            {"what": "prefill", "batch": batch, "measured_s": m_prefill, "model_s": call_s + prefill}
        )
        fitted.append({"what": "decode_step", "batch": batch, "measured_s": m_step, "model_s": step})
    return {"hbm_fraction": hbm, "infer_mfu": mfu}, fitted, call_s


def _fit_train(
    pool: Pool, model: ModelShape, train: Mapping, calibration: Calibration
) -> tuple[dict[str, float], dict[str, Any]]:
    gpus = int(_number(train, "gpus", "train"))
    sequences = int(_number(train, "sequences", "train"))
    length = int(_number(train, "sequence_tokens", "train"))
    minibatches = int(train.get("minibatches") or 1)
    measured = _number(train, "step_s", "train") + _number(train, "logp_s", "train")
    # Fixed-length sequences attend over half their length on average, however prompt and output split them.
    cluster, workload = probe_setting(
        pool, model, gpus, length // 2, length - length // 2, sequences, minibatches
    )
    stages = (TrainStage(PROBE, gpus, 1),)

    def step(mfu: float) -> float:
        # The measured step is the actor's alone: none of the trainer's per-step work around it.
        cal = calibration.with_factors(pool.gpu_type, {"train_mfu": mfu})
        est = estimate_train(cluster, workload, cal, stages, check_memory=False)
        if not est.feasible:
            raise HexError("measurements", f"train: {est.reason}", "measure a layout one machine can hold")
        return est.step_time_s

    # Slower than measured even at peak: report the cap and the gap.
    mfu = bisect_factor(lambda f: step(f) > measured, *_bounds("train_mfu"))
    point = {"what": "train_step", "batch": sequences, "measured_s": measured, "model_s": step(mfu)}
    return {"train_mfu": mfu}, point


def fit_profile(
    pool: Pool, model: ModelShape, measurements: Mapping, calibration: Calibration | None = None
) -> ProfileFit:
    """Fit ``pool``'s GPU type's factors to ``measurements`` (format :data:`MEASUREMENTS_FORMAT`)."""
    if not isinstance(measurements, Mapping) or measurements.get("format") != MEASUREMENTS_FORMAT:
        raise HexError(
            "measurements", "are not areal-hex measurements", f"expected format {MEASUREMENTS_FORMAT!r}"
        )
    if measurements.get("model") != model.name:
        raise HexError(
            "measurements",
            f"were taken with model {measurements.get('model')!r}, the recipe's model is {model.name!r}",
            "profile with this recipe, or fit with the recipe that was measured",
        )
    # The per-iteration decode overhead is held at the generic figure: one model's batch sweep cannot tell it
    # from the weight read (both are the same at every batch size).
    calibration = (calibration or Calibration()).with_factors(
        pool.gpu_type, {"decode_overhead_s": GENERIC.decode_overhead_s}
    )
    factors: dict[str, float] = {}
    train = measurements.get("train")
    if not isinstance(train, Mapping):
        raise HexError("measurements", "train is missing", "re-run areal-hex profile")
    factors.update(_fit_link(pool, train))
    calibration = calibration.with_factors(pool.gpu_type, factors)
    rollout, points, call_s = _fit_rollout(pool, model, measurements.get("decode"), calibration)
    factors.update(rollout)
    calibration = calibration.with_factors(pool.gpu_type, rollout)
    trained, point = _fit_train(pool, model, train, calibration)
    factors.update(trained)
    return ProfileFit({k: float(f"{v:.4g}") for k, v in factors.items()}, [*points, point], call_s)
