"""``hex/*`` metrics and the plan, logged through upstream's StatsLogger (upstream owns the wandb run).

Per step: predicted vs measured rollout wait, train time (and its two phases: the forward-only log-prob passes and
the update) and weight-sync time, measured tokens/s (generated tokens over the wall time between commits),
tokens/s per rollout pool (by the samples each pool finished) and tokens per dollar at the plan's $/h. The plan goes into the run config and, once, into a ``wandb.Table``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from areal_hex_plugin.plan import HexPlan

# Upstream's keys (areal 1.0.4): controller timings and the actor's generated-token count per step.
MEASURED = {
    "rollout_s": "timeperf/rollout",
    "weight_sync_s": "timeperf/update_weights",
}
# The train phase as the cost model prices it: the forward-only log-prob passes, then the update.
LOGP_PASSES = ("timeperf/ref_logp", "timeperf/recompute_logp")
UPDATE = "timeperf/train_step"
GENERATED_TOKENS = "ppo_actor/n_valid_tokens"
PLAN_COLUMNS = ["pool", "host", "gpu_type", "role", "gpus"]


def measured_train(data: dict[str, float]) -> dict[str, float]:
    """A step's measured train phase: ``train_s`` (log-prob passes and update), ``logp_s`` and ``update_s``;
    empty when upstream logged no update."""
    if UPDATE not in data:
        return {}
    logp = sum(data.get(key, 0.0) for key in LOGP_PASSES)
    return {"train_s": logp + data[UPDATE], "logp_s": logp, "update_s": data[UPDATE]}


def step_metrics(plan: HexPlan, data: dict[str, float], step_s: float | None) -> dict[str, float]:
    """The ``hex/*`` scalars for one step, from upstream's committed ``data`` and the step's wall time."""
    p = plan.predicted
    out = {
        "hex/predicted/rollout_s": p.rollout_time_s,
        "hex/predicted/train_s": p.train_time_s,
        "hex/predicted/weight_sync_s": p.weight_sync_s,
        "hex/predicted/step_s": p.step_time_s,
        "hex/predicted/tokens_per_s": p.tokens_per_s,
        "hex/predicted/tokens_per_dollar": p.tokens_per_dollar,
        "hex/cost_per_hour": p.cost_per_hour,
    }
    if p.train_logp_s is not None:
        out["hex/predicted/logp_s"] = p.train_logp_s
        out["hex/predicted/update_s"] = p.train_time_s - p.train_logp_s
    out.update({f"hex/measured/{name}": data[key] for name, key in MEASURED.items() if key in data})
    out.update({f"hex/measured/{name}": value for name, value in measured_train(data).items()})
    tokens = data.get(GENERATED_TOKENS)
    if tokens is not None and step_s:
        tokens_per_s = tokens / step_s
        out["hex/measured/step_s"] = step_s
        out["hex/measured/tokens_per_s"] = tokens_per_s
        out["hex/measured/tokens_per_dollar"] = tokens_per_s * 3600.0 / p.cost_per_hour
        pools = {
            k.split("/")[2]: v
            for k, v in data.items()
            if k.startswith("hex/rollout/") and k.endswith("/samples")
        }
        total = sum(pools.values())
        for pool, samples in pools.items():
            if total:
                out[f"hex/pool/{pool}/tokens_per_s"] = tokens_per_s * samples / total
    return out


def plan_rows(plan: HexPlan) -> list[list[Any]]:
    return [
        [m.pool, m.host, m.gpu_type, m.role, sum(g.role != "idle" for g in m.gpus)] for m in plan.machines
    ]


class HexStatsLog:
    """Wraps upstream's StatsLogger: adds ``hex/*`` to every commit and puts the plan in the wandb run."""

    def __init__(self, inner, plan: HexPlan) -> None:
        self._inner = inner
        self._plan = plan
        # Each called with a step's committed data and global step; what it returns is logged with it (the
        # online refit).
        self.on_step: list[Callable[[dict, int], dict[str, float]]] = []
        self._last_commit = time.perf_counter()
        self._log_plan()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def _log_plan(self) -> None:
        import wandb

        if wandb.run is None:
            return
        wandb.run.config.update({"hex_plan": self._plan.to_dict()}, allow_val_change=True)
        wandb.run.log(
            {"hex/plan": wandb.Table(columns=PLAN_COLUMNS, data=plan_rows(self._plan))}, commit=False
        )

    def commit(self, epoch: int, step: int, global_step: int, data: dict | list[dict]) -> None:
        now = time.perf_counter()
        step_s, self._last_commit = now - self._last_commit, now
        items = [data] if isinstance(data, dict) else list(data)
        extra = {k: v for hook in self.on_step for k, v in hook(items[0], global_step).items()}
        items[0] = {**items[0], **step_metrics(self._plan, items[0], step_s), **extra}
        self._inner.commit(epoch, step, global_step, items[0] if isinstance(data, dict) else items)
