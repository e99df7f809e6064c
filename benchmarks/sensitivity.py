"""What ``plan``'s sensitivity costs: plan time of the shipped recipes (and the scheduler benchmark's 256- and
1,024-GPU clusters) without and with ``PlanRequest.sensitivity`` (``planner/sensitivity.py``).

    .venv/bin/python benchmarks/sensitivity.py [--json OUT] [--repeats N]

Prints (and writes) JSON: per recipe, ``plan_s`` and ``with_sensitivity_s`` (wall seconds, the least of
``--repeats`` fresh plans each, alternating; ``*_cpu_s`` the same in CPU seconds), ``candidates`` (the plans the flip check re-ranks), ``inputs``
(factors and workload figures) and ``flips`` (the changes that flip the plan).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from planner import (  # benchmarks/planner.py, beside this script
    BATCH_GPUS,
    BATCH_PROMPTS,
    SIZES,
    recipe_for,
)
from report import emit  # benchmarks/report.py, beside this script

from areal_hex_plugin.planner.recipe_planner import PlanRequest, plan_recipe
from areal_hex_plugin.specs.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
RECIPES = (
    "recipes/paper/1.5b.yaml",
    "recipes/paper/7b.yaml",
    "recipes/paper/14b.yaml",
    "recipes/mixes/a100_l40s_qwen2.5-7b.yaml",
    "recipes/mixes/h100_a100_llama3.1-8b.yaml",
    "recipes/mixes/h100_rtx4090_qwen3-4b.yaml",
    "recipes/ci/tiny.yaml",
)
CLUSTERS = (256, 1024)


def measure(recipe, repeats: int) -> dict:
    times: dict[str, list[float]] = {"plan": [], "with_sensitivity": []}
    for _ in range(repeats):
        for key, request in (("plan", PlanRequest()), ("with_sensitivity", PlanRequest(sensitivity=True))):
            wall, cpu = time.perf_counter(), time.process_time()
            plan = plan_recipe(recipe, request)
            times[key].append((time.perf_counter() - wall, time.process_time() - cpu))
    s = plan.sensitivity
    out = {}
    for key, runs in times.items():
        out[f"{key}_s"] = round(min(w for w, _ in runs), 3)
        out[f"{key}_cpu_s"] = round(min(c for _, c in runs), 3)
    return out | {
        "candidates": s.candidates,
        "inputs": sum(len(v) for v in s.factors.values()) + len(s.workload),
        "flips": [f"{f.group} {f.input} {f.change:+g}" for f in s.flips],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    report = {name: measure(load_recipe(ROOT / name, []), args.repeats) for name in RECIPES}
    for gpus in CLUSTERS:
        pools = [{"gpu_type": t, "gpus_per_machine": 8, "machines": m} for t, m in SIZES[gpus].items()]
        batch = BATCH_PROMPTS * gpus // BATCH_GPUS if gpus >= BATCH_GPUS else None
        report[f"cluster_{gpus}_gpus_7b"] = measure(recipe_for("7b", pools, 60.0, batch=batch), args.repeats)
    emit(report, args.json)


if __name__ == "__main__":
    main()
