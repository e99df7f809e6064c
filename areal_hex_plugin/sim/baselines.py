"""The check of a baseline fit: the planner's own plan on each measured homogeneous cluster, phase by phase.

AReaL is planned the way the paper ran it: one GPU type, rented by the GPU up to the measured count, upstream's
weight transport (``hex.transport: upstream``), the budget the cluster costs. The measured rollout phase is the
time rollout takes to deliver a step's batch: on a train-bound cluster that includes waiting at the staleness
bound (the paper's H20 phases are equal), so it compares with ``max(rollout, train)``; the plan's own rollout
time is kept beside it. AReaL pushes weights every step, and so does the plan here (``max_update_window`` 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.scheduler import plan_recipe
from areal_hex_plugin.sim.reproduce import paper_request
from areal_hex_plugin.specs.config import CalibrationConfig, GpuEfficiencyConfig
from areal_hex_plugin.specs.rental import rent


def with_calibration(recipe, calibration: Calibration, gpu_types: list[str]):
    """``recipe`` planned with ``calibration``'s factors for ``gpu_types`` (as recipe overrides)."""
    per_type = {t: GpuEfficiencyConfig(**calibration.as_dict([t])[t]) for t in gpu_types}
    hex_cfg = dataclasses.replace(recipe.hex, calibration=CalibrationConfig(profile=None, gpu_types=per_type))
    return dataclasses.replace(recipe, hex=hex_cfg)


def homogeneous(recipe, gpu_type: str, gpus: int):
    """``recipe`` on ``gpus`` GPUs of ``gpu_type`` alone, run as AReaL runs it: upstream's weight transport, an
    update every step."""
    cluster = rent(recipe.cluster, {gpu_type: gpus})
    solver = dataclasses.replace(recipe.hex.solver, max_update_window=1)
    rl = dataclasses.replace(recipe.workload.rl, max_update_window=1)
    return dataclasses.replace(
        recipe,
        cluster=cluster,
        hex=dataclasses.replace(recipe.hex, transport="upstream", solver=solver),
        workload=dataclasses.replace(recipe.workload, rl=rl),
    )


def baseline_phases(recipes: Mapping[str, object], calibration: Calibration, data: Mapping) -> list[dict]:
    """Per model (``recipes`` by model name) and measured cluster: each phase measured next to the plan's."""
    types = sorted({c["gpu_type"] for c in data["clusters"].values()})
    rows = []
    for model, recipe in recipes.items():
        if model not in data["models"]:
            continue
        calibrated = with_calibration(recipe, calibration, types)
        for name, c in data["clusters"].items():
            setting = homogeneous(calibrated, c["gpu_type"], int(c["gpus"]))
            plan = plan_recipe(setting, paper_request(setting))  # whole machines per role, as measured
            p = plan.predicted
            values = {
                "rollout_s": max(p.rollout_time_s, p.train_time_s),
                "train_s": p.train_time_s,
                "weight_sync_s": p.weight_sync_s,
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
