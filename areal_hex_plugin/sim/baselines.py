"""The check of a baseline fit: the planner's own plan on each measured homogeneous cluster, phase by phase.

AReaL is planned the way the paper ran it (``planner/fit_baselines.py``'s measured setting): one GPU type,
rented by the GPU up to the measured count, upstream's weight transport (``hex.transport: upstream``) and a weight
update every step, upstream's admission of one batch of rollouts (``max_concurrent_rollouts`` unset) at the
fitted staleness bound (the profile's ``measured_setting``), the run's rollout layout, and the run's own tokens per step. The measured rollout phase is the time rollout takes to
deliver a step's batch: on a train-bound cluster that includes waiting at the staleness bound, so it compares
with ``max(rollout, train)``; the plan's own rollout time is kept beside it. Where a run's two phases are equal
(the paper's H20 runs, within EQUAL_PHASES) they carry only the step, whichever phase waited, so training
compares with the step's ``max(rollout, train)`` too. The paper's metric, tokens per step over the step, is
checked as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from areal_hex_plugin.costmodel.calibration import Calibration, build_calibration
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.planner.fit_baselines import (
    EQUAL_PHASES,
    measured_eta,
    measured_workload,
    setting_from,
)
from areal_hex_plugin.sim.reproduce import as_areal_ran, paper_request, rented
from areal_hex_plugin.specs.config import CalibrationConfig, GpuEfficiencyConfig


def with_calibration(recipe, calibration: Calibration, gpu_types: list[str]):
    """``recipe`` planned with ``calibration``'s factors for ``gpu_types`` (as recipe overrides)."""
    per_type = {t: GpuEfficiencyConfig(**calibration.as_dict([t])[t]) for t in gpu_types}
    cfg = CalibrationConfig(profile=None, gpu_types=per_type)
    hex_cfg = dataclasses.replace(recipe.hex, calibration=cfg)
    return dataclasses.replace(recipe, hex=hex_cfg, calibration=build_calibration(cfg, recipe.catalog))


def homogeneous(
    recipe, gpu_type: str, gpus: int, run: Mapping, layout: list[int] | None = None, eta: int | None = None
):
    """``recipe`` on ``gpus`` GPUs of ``gpu_type`` alone, run as the measured ``run`` was: AReaL's runtime
    (``reproduce.as_areal_ran``, replicas of ``layout`` [tp, pp], staleness bound ``eta``; None: the shipped
    profile's) and the run's own tokens per step."""
    eta = measured_eta(recipe.workload.model.name) if eta is None else eta
    measured = as_areal_ran(rented(recipe, {gpu_type: gpus}), layout, eta)
    workload = measured_workload(setting_from(recipe), float(run["tokens_per_step"]), eta)
    return dataclasses.replace(measured, workload=workload)


def baseline_phases(
    recipes: Mapping[str, object],
    calibration: Calibration,
    data: Mapping,
    gpus: Mapping[str, int],
    eta: Mapping[str, int] | None = None,
) -> list[dict]:
    """Per model (``recipes`` by model name) and measured cluster of ``gpus`` GPUs (the file's count, or the fit's
    where the file leaves it open) at each model's measured staleness bound (``eta``; None: the shipped profile's): each
    phase measured next to the plan's."""
    types = sorted({c["gpu_type"] for c in data["clusters"].values()})
    rows = []
    for model, recipe in recipes.items():
        if model not in data["models"]:
            continue
        calibrated = with_calibration(recipe, calibration, types)
        for name, c in data["clusters"].items():
            run = data["models"][model][name]
            setting = homogeneous(
                calibrated,
                c["gpu_type"],
                gpus[name],
                run,
                c.get("rollout_layout"),
                None if eta is None else eta[model],
            )
            plan = plan_recipe(setting, paper_request(setting))  # whole machines per role, as measured
            p = plan.predicted
            both = max(p.rollout_time_s, p.train_time_s)
            equal = abs(run["rollout_s"] / run["train_s"] - 1) <= EQUAL_PHASES
            values = {
                "rollout_s": both,
                "train_s": both if equal else p.train_time_s,
                "weight_sync_s": p.weight_sync_s,
                "tokens_per_s": setting.workload.tokens_per_step / p.step_time_s,
            }
            for phase, value in values.items():
                rows.append(
                    {
                        "model": model,
                        "cluster": name,
                        "phase": phase,
                        "measured": float(data["models"][model][name][phase]),
                        "model_value": float(value),
                        "rollout_compute_s": float(p.rollout_time_s),
                        "split": {"train": plan.train.gpus, "rollout": plan.rollout.gpus},
                    }
                )
    return rows
