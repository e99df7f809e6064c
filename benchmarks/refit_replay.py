"""Issue 34's replay table: ``simulate --truth`` with every factor of one GPU type off by +-30%.

For each case the simulator runs on the true factors (``sim.online.factors_off``) while the planner starts from
the recipe's, with the online refit and re-plan loop on (``sim.online.simulate_truth``, 30 steps, a refit every 5):
the gap (the true-factor plan's tokens/s over the believed plan's, both on the true factors, last 10 steps), the
share of it recovered (goal: at least 80% within 30 steps), the step of the first suggested re-plan, the refit
after which no refit moves a factor by more than 5%, and the CPU seconds per refit and per re-plan decision. Run
from the repository root (a few minutes on 2 cores):

    .venv/bin/python benchmarks/refit_replay.py --json refit_replay.json --markdown
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from report import emit  # benchmarks/report.py, beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_hex_plugin.planner import plan_recipe  # noqa: E402
from areal_hex_plugin.planner.refit_replan import THRESHOLD  # noqa: E402
from areal_hex_plugin.sim.online import factors_off, simulate_truth  # noqa: E402
from areal_hex_plugin.specs.recipe import load_recipe  # noqa: E402

STEPS = 30
GOAL = 0.8
PAPER = [
    (f"paper/{n}.yaml", t, c)
    for n in ("1.5b", "7b", "14b")
    for t in ("H800-PCIe", "H20")
    for c in (0.3, -0.3)
]
CASES = [
    *PAPER,
    ("mixes/h100_a100_llama3.1-8b.yaml", "H100", -0.5),
    ("mixes/h100_rtx4090_qwen3-4b.yaml", "RTX4090", -0.3),
    ("ci/tiny.yaml", "CPU-SMALL", -0.3),
    ("ci/tiny.yaml", "CPU-BIG", 0.3),
]


def replay(recipe_file: str, gpu_type: str, change: float) -> dict:
    recipe = load_recipe(REPO / "recipes" / recipe_file, [])
    report = simulate_truth(
        recipe, plan_recipe(recipe), factors_off(recipe.calibration, gpu_type, change), STEPS
    )
    replans = [r["step"] for r in report.refits if r["decision"]["suggested"]]
    gap = report.gap
    return {
        "recipe": recipe_file,
        "gpu_type": gpu_type,
        "change": change,
        "gap": round(gap, 4),
        "recovered": None if report.recovered is None else round(report.recovered, 3),
        "replan_step": replans[0] if replans else None,
        "converged_step": report.converged_step,
        "refit_cpu_s_max": round(max(r["cpu_s"] for r in report.refits), 3),
        "decision_cpu_s_max": round(max(r["replan_cpu_s"] for r in report.refits), 3),
        # Where the gap is within the re-plan threshold there is nothing to recover, and no re-plan may be made.
        "goal_met": (report.recovered or 0) >= GOAL if gap > THRESHOLD else len(report.plans) == 1,
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| recipe | type off | gap | recovered | re-plan | converged | CPU s per refit | CPU s per decision |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        recovered = "no gap" if r["recovered"] is None else f"{r['recovered']:.0%}"
        if r["recovered"] is not None and r["gap"] <= THRESHOLD:
            recovered = "(within threshold)"
        replan = f"step {r['replan_step']}" if r["replan_step"] else "none"
        converged = f"step {r['converged_step']}" if r["converged_step"] else "none"
        lines.append(
            f"| `{r['recipe']}` | {r['gpu_type']} {r['change']:+.0%} | {r['gap']:+.1%} | {recovered} | {replan} | "
            f"{converged} | {r['refit_cpu_s_max']:.2f} | {r['decision_cpu_s_max']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown too (on stderr)")
    args = parser.parse_args()
    rows = [replay(*case) for case in CASES]
    emit({"steps": STEPS, "goal": GOAL, "threshold": THRESHOLD, "cases": rows}, args.json)
    if args.markdown:
        print(markdown(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
