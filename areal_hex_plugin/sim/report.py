"""Console text for a simulation: the steady state beside the plan's prediction."""

from __future__ import annotations

from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.sim.result import SimResult


def describe_simulation(result: SimResult, plan: HexPlan) -> str:
    p = plan.predicted
    lines = [
        f"simulated {len(result.steps)} steps ({result.warmup_steps} warm-up), {result.events:,} events",
        "",
        f"{'':24}{'planner':>12}{'simulated':>12}",
        f"{'tokens/s':24}{p.tokens_per_s:12,.0f}{result.tokens_per_s:12,.0f}",
        f"{'step (s)':24}{p.step_time_s:12.1f}{result.step_time_s:12.1f}",
        f"{'  train (s)':24}{p.train_time_s:12.1f}{result.mean('train_s'):12.1f}",
        f"{'  weight sync (s)':24}{p.weight_sync_s:12.1f}{result.mean('sync_s'):12.1f}",
        f"{'  rollout incl. reward':24}{p.rollout_time_s:12.1f}{'':>12}",
        f"{'  trainer waits (s)':24}{'':>12}{result.mean('rollout_wait_s'):12.1f}",
        f"{'  generator idles (s)':24}{'':>12}{result.rollout_idle_s:12.1f}",
        "",
        "idle fraction per pool: "
        + ", ".join(f"{name} {usage.idle_fraction:.1%}" for name, usage in result.pools.items()),
        f"sequences interrupted by weight updates: {result.interrupted:,}; an average replica then spends "
        f"{result.recompute_s_per_update:.1f} s re-prefilling their KV caches",
        "staleness of consumed samples (versions behind: samples): "
        + ", ".join(f"{lag}: {n}" for lag, n in sorted(result.staleness.items())),
    ]
    return "\n".join(lines)
