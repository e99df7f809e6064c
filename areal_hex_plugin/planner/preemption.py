"""Expected losses of preemptible (spot) machines, priced into a plan's step.

A preemptible pool loses each machine at ``lambda = preemptions_per_hour / 3600`` per second and has a replacement
serving ``R = recovery_s`` seconds later (first order in lambda: losses are rare against a step).

- **Rollout.** A lost server's in-flight samples are resubmitted (their generated tokens are lost) and the shares
  are re-solved over the survivors until the replacement serves (``planner/reshare.py``). An in-flight sequence
  is on average ``E[L^2] / (2 E[L])`` tokens old (length-biased), so a loss throws away
  ``W = c * E[L^2] / (2 E[L]) / h`` seconds of a replica of speed ``h`` running ``c`` sequences. Up a fraction
  ``1 / (1 + lambda R)`` of the time and losing ``lambda W`` of its work while up, its expected speed is
  ``h (1 - lambda W) / (1 + lambda R)``. With the shares re-solved, the fleet's rollout time grows by the ratio of
  its loss-free speed to its expected speed.
- **Training.** Losing any training machine stops the run: it waits ``R`` and resumes from the last recover
  checkpoint, redoing on average half a checkpoint interval ``I`` (``recover.freq_steps`` steps or
  ``recover.freq_secs``, the shorter). With ``Lambda`` the training machines' summed loss rate, each step takes
  ``(1 + Lambda (R + I / 2))`` times its loss-free time (``R`` the rate-weighted mean). Training stays on reliable
  pools unless ``hex.solver.train_on_preemptible``, which needs recover checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.planner.rollout_model import ReplicaConfig
from areal_hex_plugin.specs.cluster import Cluster, Pool
from areal_hex_plugin.specs.workload import LengthDistribution


@dataclass(frozen=True)
class Loss:
    """A plan's expected losses: ``rollout`` is the share of its fleet's loss-free speed left; each step is
    stretched by ``restart`` (expected restart seconds per second of run, ``Lambda * R``) plus ``Lambda / 2`` of a
    checkpoint interval of ``checkpoint_steps`` steps or ``checkpoint_s`` seconds (the shorter)."""

    rollout: float = 1.0
    restarts_per_s: float = 0.0  # Lambda
    restart_s: float = 0.0  # R, the loss-rate-weighted recovery of the training machines
    checkpoint_steps: int | None = None
    checkpoint_s: float | None = None

    def step_s(self, sync_s: float, rollout_s: float, train_s: float) -> float:
        """Expected seconds per step from its loss-free parts (weight sync per step, rollout, training)."""
        step = sync_s + max(rollout_s / self.rollout if self.rollout > 0 else math.inf, train_s)
        if not self.restarts_per_s or not math.isfinite(step):
            return step
        intervals = [
            x
            for x in (self.checkpoint_steps and self.checkpoint_steps * step, self.checkpoint_s)
            if x is not None
        ]
        return step * (1 + self.restarts_per_s * (self.restart_s + min(intervals, default=math.inf) / 2))


@dataclass(frozen=True)
class Preemption:
    """The preemptible pools of a cluster and the recover checkpoints a run on them writes."""

    pools: dict[str, Pool]
    train_allowed: bool
    lengths: LengthDistribution
    checkpoint_steps: int | None = None
    checkpoint_s: float | None = None

    def may_train(self, gpus: dict[str, int]) -> bool:
        """Whether training may use these GPUs per pool (on a preemptible pool only when allowed)."""
        return self.train_allowed or not any(n and name in self.pools for name, n in gpus.items())

    def replica_factor(self, config: ReplicaConfig) -> float:
        """A replica's expected share of its loss-free speed: (1 - lambda W) / (1 + lambda R)."""
        pool = self.pools.get(config.pool)
        if pool is None or config.tokens_per_s <= 0:
            return 1.0
        rate = pool.preemptions_per_hour / 3600
        lengths = self.lengths.lengths
        age = sum(n * n for n in lengths) / (2 * sum(lengths))  # mean tokens an in-flight sequence has done
        lost_s = config.concurrency * age / config.tokens_per_s
        return max(0.0, 1 - rate * lost_s) / (1 + rate * pool.recovery_s)

    def loss(self, train_gpus: dict[str, int], groups: tuple[tuple[ReplicaConfig, int], ...]) -> Loss:
        """The expected losses of a plan training on ``train_gpus`` (GPUs per pool) with these replica groups."""
        speed = sum(c.tokens_per_s * y for c, y in groups)
        expected = sum(c.tokens_per_s * y * self.replica_factor(c) for c, y in groups)
        rates = {
            name: math.ceil(n / pool.gpus_per_machine) * pool.preemptions_per_hour / 3600
            for name, n in train_gpus.items()
            if n and (pool := self.pools.get(name)) is not None
        }
        total = sum(rates.values())
        restart = sum(r * self.pools[name].recovery_s for name, r in rates.items()) / total if total else 0.0
        return Loss(
            expected / speed if speed > 0 else 1.0, total, restart, self.checkpoint_steps, self.checkpoint_s
        )


def preemption_of(recipe) -> Preemption | None:
    """The recipe's preemptible pools (None when it has none); refuses training on them without recover
    checkpoints."""
    cluster: Cluster = recipe.cluster
    pools = {p.name: p for p in cluster.pools if p.preemptible}
    if not pools:
        return None
    allowed = recipe.hex.solver.train_on_preemptible
    up = recipe.upstream
    steps, secs = up["recover.freq_steps"], up["recover.freq_secs"]
    if allowed:
        fix = "or set hex.solver.train_on_preemptible=false to keep training on reliable pools"
        if up["recover.mode"] not in ("on", "auto"):
            raise HexError(
                "recover.mode",
                f"is {up['recover.mode']!r}, so a training machine lost on a preemptible pool "
                f"({', '.join(pools)}) restarts the run from scratch",
                f"set recover.mode=auto and recover.freq_steps (e.g. 10), {fix}",
            )
        if steps is None and secs is None:
            raise HexError(
                "recover.freq_steps",
                f"is unset and so is recover.freq_secs: training on a preemptible pool ({', '.join(pools)}) "
                "needs recover checkpoints to resume from",
                f"set recover.freq_steps (e.g. 10) or recover.freq_secs, {fix}",
            )
    return Preemption(pools, allowed, recipe.workload.output_lengths, steps, secs)
