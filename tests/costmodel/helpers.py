"""Recipes and cost models shared by the cost-model tests (loaded once: loading is pure)."""

from __future__ import annotations

from functools import cache

from areal_hex_plugin.costmodel import CostModel, RolloutStage
from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.costmodel.fit import MEASUREMENTS_FORMAT, PROBE, probe_setting
from areal_hex_plugin.costmodel.rollout import batch_timings
from areal_hex_plugin.costmodel.train import TrainStage, estimate_train
from areal_hex_plugin.specs.cluster import Pool
from areal_hex_plugin.specs.recipe import Recipe, load_recipe
from tests.conftest import REPO

# Factors the profile tests write measurements with, and expect the fit to hand back.
TRUTH = {"hbm_fraction": 0.7, "infer_mfu": 0.55, "train_mfu": 0.33, "link_efficiency": 0.7}


@cache
def recipe(name: str, *overrides: str) -> Recipe:
    return load_recipe(REPO / "recipes" / name, list(overrides))


def cost_model(name: str, *overrides: str) -> CostModel:
    r = recipe(name, *overrides)
    return CostModel(r.cluster, r.workload, r.calibration)


def pool_of(r: Recipe, gpu_type: str) -> Pool:
    return next(p for p in r.cluster.pools if p.gpu_type == gpu_type)


def synthetic_measurements(
    r: Recipe, gpu_type: str, truth: dict, tp: int = 1, noise: float = 0.0, gpus: int = 8
) -> dict:
    """Measurements the cost model predicts under ``truth``; ``noise`` alternately inflates and deflates them."""
    pool, model = pool_of(r, gpu_type), r.workload.model
    cal = Calibration().with_factors(gpu_type, truth)
    prompt, generated = 1024, 128
    cluster, workload = probe_setting(pool, model, tp, prompt, generated, 128)
    batches = (1, 8, 32, 128)
    timings = batch_timings(
        cluster, workload, cal, (RolloutStage(PROBE, tp),), batches, prompt + generated / 2
    )
    points = []
    for i, (batch, (prefill, step)) in enumerate(zip(batches, timings, strict=True)):
        wobble = 1 + noise * (-1) ** i
        prefill, step = prefill * wobble, step / wobble
        points.append(
            {"batch": batch, "prefill_s": prefill, "generate_s": prefill + step * 127, "step_s": step}
        )
    sequences, length = 2 * gpus, 4096
    cluster, workload = probe_setting(pool, model, gpus, length // 2, length // 2, sequences)
    step = estimate_train(cluster, workload, cal, (TrainStage(PROBE, gpus, 1),), check_memory=False)
    bus = truth["link_efficiency"] * pool.intra_machine_gb_per_s
    return {
        "format": MEASUREMENTS_FORMAT,
        "gpu_type": gpu_type,
        "device_name": f"NVIDIA {gpu_type}",
        "model": model.name,
        "decode": {"engine": "sglang", "tp": tp, "prompt_tokens": prompt, "decode_tokens": generated,
                   "points": points},
        "train": {"engine": "fsdp", "gpus": gpus, "sequences": sequences, "sequence_tokens": length,
                  "tokens": sequences * length, "gradient_checkpointing": True, "minibatches": 1,
                  "logp_s": step.step_time_s * 0.2 * (1 + noise), "step_s": step.step_time_s * 0.8 * (1 + noise),
                  "allreduce_bus_gb_per_s": bus * (1 - noise), "device_name": f"NVIDIA {gpu_type}"},
    }  # fmt: skip
