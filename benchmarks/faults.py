"""Faults benchmark: a 1,024-GPU cluster's plan replayed with machine losses, returns and length drift
(``simulate --faults``).

    .venv/bin/python benchmarks/faults.py [--json OUT]

Prints (and writes) JSON: the plan (7B on an inventory of 32 H800 + 96 H20 machines, 512 prompts x 16 samples per
step, no budget: the fastest plan, whose GPUs and replicas the JSON counts) and its planning seconds, then for each
scenario over 30 steps (seed 0) the wall seconds of the simulation with the faults and of the same run without
them, tokens/s with and without, samples resubmitted, training steps lost and seconds stalled:
- ``rollout``: four rollout machines lost 20 s apart, two of them back later, output lengths x1.5 and back;
- ``trainer``: the same, plus a training machine lost mid-run (600 s to a replacement, a checkpoint every 5 steps).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import yaml
from report import emit  # benchmarks/report.py, beside this script

from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.sim.engine import default_warmup
from areal_hex_plugin.sim.fault_file import read_faults
from areal_hex_plugin.sim.faults import FaultLoop, setting_of
from areal_hex_plugin.sim.inputs import sim_spec
from areal_hex_plugin.specs.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
STEPS = 30
OVERRIDES = [
    "hex.cluster.pools.0.machines=32",
    "hex.cluster.pools.1.machines=96",
    "hex.objective.budget_per_hour=null",
    "train_dataset.batch_size=512",
    "recover.mode=auto",
    "recover.freq_steps=5",
    "++hex.solver.time_limit_s=20",
]


def scenario(plan, step_s: float, trainer: bool) -> list[dict]:
    """Events at fractions of the run: rollout machines lost and back, lengths drifting, maybe the trainer."""
    rollout = sorted({m.host for m in plan.machines if m.role == "rollout"})
    training = sorted({m.host for m in plan.machines if m.role == "train"})
    run = STEPS * step_s
    events = [{"at_s": round(0.3 * run + 20 * k, 1), "lost": host} for k, host in enumerate(rollout[:4])]
    events += [{"at_s": round(0.5 * run + 20 * k, 1), "back": host} for k, host in enumerate(rollout[:2])]
    events += [
        {"at_s": round(0.4 * run, 1), "length_scale": 1.5},
        {"at_s": round(0.7 * run, 1), "length_scale": 1},
    ]
    if trainer:
        events.append({"at_s": round(0.6 * run, 1), "lost": training[0], "recovery_s": 600})
    return events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the JSON here")
    args = parser.parse_args()
    recipe = load_recipe(ROOT / "recipes" / "paper" / "7b.yaml", OVERRIDES)
    start = time.perf_counter()
    plan = plan_recipe(recipe)
    planned = time.perf_counter() - start
    spec = sim_spec(recipe, plan)
    setting = setting_of(recipe, plan)
    report = {
        "plan": {
            "gpus": sum(plan.train.gpus.values()) + sum(plan.rollout.gpus.values()),
            "rollout_replicas": sum(g.count for g in plan.rollout.replicas),
            "samples_per_step": recipe.workload.rl.samples_per_step,
            "predicted_tokens_per_s": plan.predicted.tokens_per_s,
            "planning_s": round(planned, 2),
        },
        "steps": STEPS,
    }
    with tempfile.TemporaryDirectory() as folder:
        for name, trainer in (("rollout", False), ("trainer", True)):
            path = Path(folder) / f"{name}.yml"
            path.write_text(yaml.safe_dump({"faults": scenario(plan, plan.predicted.step_time_s, trainer)}))
            faults = read_faults(str(path), recipe, plan)
            start = time.perf_counter()
            hit = FaultLoop(spec, 0, False, faults, setting).outcome(STEPS, default_warmup(STEPS))
            with_faults = time.perf_counter() - start
            start = time.perf_counter()
            clean = FaultLoop(spec, 0, False, [], setting).outcome(STEPS, default_warmup(STEPS))
            without = time.perf_counter() - start
            report[name] = {
                "events": len(faults),
                "simulate_s_with_faults": round(with_faults, 2),
                "simulate_s_without_faults": round(without, 2),
                "sim_events": hit.result.events,
                "tokens_per_s_all_steps": round(hit.result.tokens_per_s_all_steps, 1),
                "tokens_per_s_all_steps_without_faults": round(clean.result.tokens_per_s_all_steps, 1),
                "samples_resubmitted": hit.resubmitted,
                "steps_lost": hit.steps_lost,
                "stall_s": hit.stall_s,
                "drift_rebalances": hit.rebalances,
            }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
