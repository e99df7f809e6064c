"""Console text for a simulation: the steady state beside the plan's prediction."""

from __future__ import annotations

from typing import IO

from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.sim.agreement import plan_gap
from areal_hex_plugin.sim.result import SimResult
from areal_hex_plugin.tables import render_table


def describe_simulation(result: SimResult, plan: HexPlan, stream: IO[str] | None = None) -> str:
    p = plan.predicted
    rows = [
        ["tokens/s", f"{p.tokens_per_s:,.0f}", f"{result.tokens_per_s:,.0f}"],
        ["step (s)", f"{p.step_time_s:.1f}", f"{result.step_time_s:.1f}"],
        ["  train (s)", f"{p.train_time_s:.1f}", f"{result.mean('train_s'):.1f}"],
        ["  weight sync (s)", f"{p.weight_sync_s:.1f}", f"{result.mean('sync_s'):.1f}"],
        ["  rollout incl. reward (s)", f"{p.rollout_time_s:.1f}", ""],
        ["  trainer waits (s)", "", f"{result.mean('rollout_wait_s'):.1f}"],
        ["  generator idles (s)", "", f"{result.rollout_idle_s:.1f}"],
    ]
    lines = [
        f"simulated {len(result.steps)} steps ({result.warmup_steps} warm-up), {result.events:,} events",
        "",
        render_table(["", "planner", "simulated"], rows, right=["planner", "simulated"], stream=stream),
        "",
        "idle fraction per pool: "
        + ", ".join(f"{name} {usage.idle_fraction:.1%}" for name, usage in result.pools.items()),
        f"sequences interrupted by weight updates: {result.interrupted:,}; an average replica then spends "
        f"{result.recompute_s_per_update:.1f} s re-prefilling their KV caches",
        "staleness of consumed samples (versions behind: samples): "
        + ", ".join(f"{lag}: {n}" for lag, n in sorted(result.staleness.items())),
    ]
    gap = plan_gap(result, plan)
    if gap:
        lines.append(gap.warning())
    return "\n".join(lines)
