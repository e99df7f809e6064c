"""The elastic tests' recipe and plan: the CI recipe with outputs long enough to double (its learning run caps them
at 4 tokens), and a plan laid out by hand as a user may edit a saved one, updating weights after every step."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.run import RECIPE, REPO, overrides

# Outputs of about 12 tokens under a cap of 16, so the stand-in's served lengths can double (4 -> 8) mid-run.
LONGER = (
    "gconfig.max_new_tokens=16",
    "hex.workload.output_lengths.mean_tokens=12",
    "hex.workload.output_lengths.sigma=0.5",
)


def elastic_recipe():
    from areal_hex_plugin.specs.recipe import load_recipe

    return load_recipe(RECIPE, list(LONGER), base_dir=REPO)


def two_layout_plan(folder: Path, scheduler: str, steps: int = 8) -> Path:
    """For ``hex.plan_path`` (the driver checks it as it checks any saved plan, before anything starts): FSDP dp2
    on big-0 and big-1, a tp1 server on big-2 and a tp2 server on small-0's two GPUs, each with the cost model's
    speed for its layout and a share in proportion to it, the small server's batch capped at 4, weights pushed
    after every step. The planner's plan for the recipe gives the rest (objective, predictions, staleness)."""
    from areal_hex_plugin.costmodel import CostModel, RolloutStage
    from areal_hex_plugin.plan import HexPlan
    from areal_hex_plugin.planner import plan_recipe
    from areal_hex_plugin.specs.recipe import load_recipe

    recipe = load_recipe(RECIPE, [*overrides(folder, scheduler, steps), *LONGER], base_dir=REPO)
    plan = plan_recipe(recipe).to_dict()
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    groups = []
    for pool, gpu_type, tp, cap in (("big", "CPU-BIG", 1, None), ("small", "CPU-SMALL", 2, 4)):
        estimate = cm.rollout((RolloutStage(pool=pool, tp=tp),))
        groups.append(
            {"pool": pool, "gpu_type": gpu_type, "tp": tp, "pp": 1, "count": 1,
             "tokens_per_s": round(estimate.tokens_per_s, 3), "concurrency": cap or estimate.concurrency}
        )  # fmt: skip
    samples = recipe.workload.rl.samples_per_step
    total = sum(g["tokens_per_s"] for g in groups)
    for g in groups:
        g["share"] = round(g["tokens_per_s"] / total, 6)
    groups[0]["samples_per_step"] = round(samples * groups[0]["share"])
    groups[1]["samples_per_step"] = samples - groups[0]["samples_per_step"]
    train = {"gpu": 0, "role": "train", "stage": 0, "tp_rank": 0}
    serve = {"gpu": 0, "role": "rollout", "stage": 0, "instance": 0, "tp_rank": 0}
    plan["train"].update(
        gpus={"CPU-BIG": 2},
        stages=[
            {"pool": "big", "gpu_type": "CPU-BIG", "dp": 2, "tp": 1, "layers": 2, "hosts": ["big-0", "big-1"]}
        ],
    )
    plan["rollout"] = {"gpus": {"CPU-BIG": 1, "CPU-SMALL": 2}, "replicas": groups}
    plan["machines"] = [
        {"pool": "big", "host": "big-0", "gpu_type": "CPU-BIG", "role": "train", "gpus": [{**train, "dp_rank": 0}]},
        {"pool": "big", "host": "big-1", "gpu_type": "CPU-BIG", "role": "train", "gpus": [{**train, "dp_rank": 1}]},
        {"pool": "big", "host": "big-2", "gpu_type": "CPU-BIG", "role": "rollout", "gpus": [{**serve, "group": 0}]},
        {"pool": "small", "host": "small-0", "gpu_type": "CPU-SMALL", "role": "rollout",
         "gpus": [{**serve, "group": 1}, {**serve, "gpu": 1, "group": 1, "tp_rank": 1}]},
    ]  # fmt: skip
    plan["solver"]["window_steps"] = 1
    return HexPlan.from_dict(plan).save(folder / "two-layouts.json")
