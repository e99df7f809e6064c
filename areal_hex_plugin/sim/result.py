"""What a simulation measured: per-step records and the steady-state summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    """One training step as the trainer saw it (upstream's timeperf/rollout; recompute_logp, ref_logp and
    train_step; update_weights)."""

    start_s: float  # the previous weight update finished (or t = 0)
    rollout_wait_s: float  # waiting for the batch
    train_s: float
    sync_s: float
    tokens: int  # prompt + generated tokens of the consumed batch

    @property
    def end_s(self) -> float:
        return self.start_s + self.rollout_wait_s + self.train_s + self.sync_s

    @property
    def step_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class PoolUsage:
    """GPU-seconds of one pool in the measured window, split by what the GPUs did."""

    gpus: int
    train_s: float
    rollout_s: float  # decoding or prefilling (KV recompute included)
    sync_s: float
    idle_s: float
    rollout_gpus: int = 0  # of ``gpus``, those generating
    rollout_idle_s: float = 0.0  # of ``idle_s``, the generating GPUs' share

    @property
    def idle_fraction(self) -> float:
        total = self.train_s + self.rollout_s + self.sync_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    state: str  # decode | prefill | sync | idle | train | wait | stall (waiting for a lost training machine)


def row_order(name: str) -> tuple:
    """Timeline rows in reading order: the trainer, then replicas by group and number ("a #2" before "a #10")."""
    group, _, number = name.rpartition(" #")
    return (name != "trainer", group or name, int(number) if number.isdigit() else -1)


@dataclass(frozen=True)
class SimResult:
    steps: list[StepRecord]
    warmup_steps: int  # the first steps (pipeline fill) left out of the steady-state figures
    pools: dict[str, PoolUsage]
    staleness: dict[int, int]  # version lag at consumption -> samples consumed
    interrupted: int  # sequences interrupted by weight updates (KV recomputed)
    routed: dict[str, int]  # replica group -> rollouts sent to it
    recompute_s_per_update: float  # seconds an average replica re-prefills KV caches after a weight update
    events: int
    timeline: dict[str, dict[str, list[Segment]]] = field(default_factory=dict)  # pool -> row -> segments

    @property
    def measured(self) -> list[StepRecord]:
        return self.steps[self.warmup_steps :]

    @property
    def step_time_s(self) -> float:
        window = self.measured
        return sum(s.step_s for s in window) / len(window)

    @property
    def tokens_per_s(self) -> float:
        """Steady state: tokens consumed per second of wall time over the measured steps."""
        window = self.measured
        return sum(s.tokens for s in window) / sum(s.step_s for s in window)

    @property
    def tokens_per_s_all_steps(self) -> float:
        return sum(s.tokens for s in self.steps) / self.steps[-1].end_s

    @property
    def rollout_idle_s(self) -> float:
        """Seconds per measured step an average generating GPU has nothing to decode or prefill."""
        gpus = sum(u.rollout_gpus for u in self.pools.values())
        steps = len(self.measured)
        return sum(u.rollout_idle_s for u in self.pools.values()) / gpus / steps if gpus and steps else 0.0

    def mean(self, attribute: str) -> float:
        window = self.measured
        return sum(getattr(s, attribute) for s in window) / len(window)

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": len(self.steps),
            "warmup_steps": self.warmup_steps,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_all_steps": self.tokens_per_s_all_steps,
            "simulated_step_s": self.step_time_s,
            "breakdown_s": {
                "rollout_wait": self.mean("rollout_wait_s"),
                "train": self.mean("train_s"),
                "sync": self.mean("sync_s"),
                "rollout_idle": self.rollout_idle_s,
            },
            "idle_fraction": {name: usage.idle_fraction for name, usage in self.pools.items()},
            "pools": {
                name: {
                    "gpus": u.gpus,
                    "train_gpu_s": u.train_s,
                    "rollout_gpu_s": u.rollout_s,
                    "sync_gpu_s": u.sync_s,
                    "idle_gpu_s": u.idle_s,
                }
                for name, u in self.pools.items()
            },
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "interrupted_sequences": self.interrupted,
            "kv_recompute_s_per_update": self.recompute_s_per_update,
            "rollouts_per_group": self.routed,
            "events": self.events,
            "per_step": [
                {
                    "start_s": s.start_s,
                    "rollout_wait_s": s.rollout_wait_s,
                    "train_s": s.train_s,
                    "sync_s": s.sync_s,
                    "tokens": s.tokens,
                }
                for s in self.steps
            ],
        }
