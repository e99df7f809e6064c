"""Simulator benchmark: planner vs simulator agreement on every shipped recipe, and scale.

    .venv/bin/python benchmarks/simulator.py --json OUT [--quick]

Prints (and writes) JSON:
- ``agreement.<recipe>``: the planner's ``predicted_step_s`` and the simulator's ``simulated_step_s`` (30 steps,
  seed 0), their relative difference, and two diagnostics that show which model a gap comes from: the simulated
  step without the KV recompute that upstream's interrupted generation pays after each weight update, and the
  simulated rollout time per step with training made instant (to compare with the planner's ``rollout_s``);
- ``scale``: a 10,000-GPU heterogeneous plan (H800 training, H20 and H800 rollout groups, 7B) simulated for 50
  steps: wall time, events and events per second, and a rerun with the same seed to check determinism.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from report import emit  # benchmarks/report.py, beside this script

from areal_hex_plugin.costmodel import CostModel, RolloutStage
from areal_hex_plugin.plan import (
    HexPlan,
    Objective,
    Predicted,
    ReplicaGroup,
    RolloutPlan,
    SolverInfo,
    Staleness,
    TrainPlan,
    TrainStage,
)
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.sim.engine import simulate
from areal_hex_plugin.sim.inputs import sim_spec
from areal_hex_plugin.specs.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
STEPS = 30
# The scale plan: 7B on 256 H800 and 1,000 H20 machines (10,048 GPUs, 10,000 used), 2,048 prompts x 16 per step.
SCALE_OVERRIDES = [
    "hex.cluster.pools.0.machines=256",
    "hex.cluster.pools.1.machines=1000",
    "train_dataset.batch_size=2048",
]


def agreement(quick: bool) -> dict:
    out = {}
    recipes = sorted((ROOT / "recipes").glob("*/*.yaml"))
    for path in recipes[:1] if quick else recipes:
        recipe = load_recipe(path, ["++hex.solver.time_limit_s=20"])
        plan = plan_recipe(recipe)
        spec = sim_spec(recipe, plan)
        result = simulate(spec, steps=STEPS, seed=0)
        no_recompute = simulate(dataclasses.replace(spec, kv_recompute=False), steps=STEPS, seed=0)
        # Generation alone: instant training, no KV recompute; the step minus the sync is the rollout time.
        rollout_only = simulate(
            dataclasses.replace(spec, kv_recompute=False, train_s=0.0), steps=STEPS, seed=0
        )
        predicted = plan.predicted.step_time_s
        simulated = result.step_time_s
        out[str(path.relative_to(ROOT))] = {
            "predicted_step_s": predicted,
            "simulated_step_s": simulated,
            "relative_difference": simulated / predicted - 1,
            "within_10pct": abs(simulated / predicted - 1) <= 0.10,
            "simulated_step_s_without_kv_recompute": no_recompute.step_time_s,
            "simulated_rollout_s_alone": rollout_only.step_time_s - spec.sync_s,
            "predicted_tokens_per_s": plan.predicted.tokens_per_s,
            "simulated_tokens_per_s": result.tokens_per_s,
            "predicted": {
                "train_s": plan.predicted.train_time_s,
                "rollout_s": plan.predicted.rollout_time_s,
                "sync_s": plan.predicted.weight_sync_s,
            },
            "simulated_breakdown_s": result.to_dict()["breakdown_s"],
            "idle_fraction": result.to_dict()["idle_fraction"],
        }
    return out


def scale_plan(recipe) -> HexPlan:
    """10,000 GPUs: 2,048 H800 train (FSDP DP 2,048), 6,000 H20 at TP1 and 976 H800 TP2 replicas generate."""
    h20 = ReplicaGroup("h20", "H20", 1, 1, 6000, 0.8, 0, 0.0, 0)
    h800 = ReplicaGroup("h800", "H800-PCIe", 2, 1, 976, 0.2, 0, 0.0, 0)
    groups = []
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    for group in (h20, h800):
        estimate = cm.rollout((RolloutStage(group.pool, group.tp),))
        groups.append(
            dataclasses.replace(group, tokens_per_s=estimate.tokens_per_s, concurrency=estimate.concurrency)
        )
    total = sum(g.count * g.tokens_per_s for g in groups)
    groups = [dataclasses.replace(g, share=g.count * g.tokens_per_s / total) for g in groups]
    zero = Predicted(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return HexPlan(
        recipe=str(recipe.path),
        model=recipe.workload.model.name,
        objective=Objective("max_throughput"),
        predicted=zero,
        train=TrainPlan({"H800-PCIe": 2048}, [TrainStage("h800", "H800-PCIe", 2048, 1, 28, [])]),
        rollout=RolloutPlan({"H20": 6000, "H800-PCIe": 1952}, groups),
        machines=[],
        baselines={},
        solver=SolverInfo(0.0, "hand-made", 0, 0.0),
        # As the planner sets it: every replica's full batch may be in flight.
        staleness=Staleness(
            recipe.workload.rl.max_head_offpolicyness, sum(g.count * g.concurrency for g in groups)
        ),
    )


def scale(quick: bool) -> dict:
    recipe = load_recipe(ROOT / "recipes" / "paper" / "7b.yaml", SCALE_OVERRIDES)
    spec = sim_spec(recipe, scale_plan(recipe))
    steps = 10 if quick else 50
    start = time.perf_counter()
    result = simulate(spec, steps=steps, seed=0)
    wall = time.perf_counter() - start
    again = simulate(spec, steps=steps, seed=0)
    return {
        "gpus": sum(spec.train_gpus.values()) + sum(spec.rollout_gpus.values()),
        "replicas": sum(lane.count for lane in spec.lanes),
        "steps": steps,
        "wall_s": wall,
        "events": result.events,
        "events_per_s": result.events / wall,
        "deterministic": again.to_dict() == result.to_dict(),
        "simulated_step_s": result.step_time_s,
        "tokens_per_s": result.tokens_per_s,
        "idle_fraction": result.to_dict()["idle_fraction"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the JSON here")
    parser.add_argument(
        "--quick", action="store_true", help="one recipe and a 10-step scale run (smoke test)"
    )
    args = parser.parse_args()
    report = {"agreement": agreement(args.quick), "scale": scale(args.quick)}
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
