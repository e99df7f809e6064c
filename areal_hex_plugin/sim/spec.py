"""What the simulator needs to know, as plain numbers: built from a plan and the cost model by ``inputs.py``,
or written directly by tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaneSpec:
    """``count`` identical rollout replicas (one plan replica group).

    A replica decodes its running sequences in lock-step: one token each per decode step, which takes
    ``step_s[n - 1]`` seconds with ``n`` sequences running (continuous batching). At most ``len(step_s)``
    sequences run; more wait in the replica's queue. Prefill (new prompts, and the KV recompute of every running
    sequence after a weight update) stalls the replica at ``prefill_tokens_per_s``.
    """

    name: str
    pool: str
    gpus_per_replica: int
    count: int
    share: float
    step_s: tuple[float, ...]
    prefill_tokens_per_s: float

    @property
    def max_running(self) -> int:
        return len(self.step_s)

    def tokens_per_s(self, running: int) -> float:
        """One replica's decode rate with ``running`` sequences in flight."""
        return running / self.step_s[running - 1]


def linear_steps(fixed_s: float, per_seq_s: float, max_running: int) -> tuple[float, ...]:
    """A decode-step table ``fixed_s + per_seq_s * n`` for n = 1 .. ``max_running``."""
    return tuple(fixed_s + per_seq_s * n for n in range(1, max_running + 1))


@dataclass(frozen=True)
class SimSpec:
    """One plan's asynchronous RL loop.

    ``batch`` rollouts (prompts) per training step, each of ``n_samples`` sequences of ``prompt_tokens`` plus a
    length drawn from ``lengths``. Admission follows upstream's staleness manager with ``max_staleness`` (eta)
    and ``max_concurrent_rollouts``. A step trains for ``train_s`` on ``train_gpus`` (GPUs per pool), then
    pauses generation for the ``sync_s`` weight update (after every ``update_interval``-th step only). Rewards take ``reward_s_per_sample`` each on
    ``reward_workers`` parallel workers once a rollout's samples are all generated.
    """

    lanes: tuple[LaneSpec, ...]
    lengths: tuple[int, ...]
    prompt_tokens: int
    n_samples: int
    batch: int
    max_staleness: int
    max_concurrent_rollouts: int
    train_s: float
    sync_s: float
    train_gpus: dict[str, int]
    reward_s_per_sample: float = 0.0
    reward_workers: int = 1
    consumer_batch: int | None = None  # upstream's rollout.consumer_batch_size (default: ``batch``)
    kv_recompute: bool = (
        True  # interrupted sequences re-prefill their KV cache (upstream aborts and resubmits)
    )
    update_interval: int = 1  # training steps per weight update (the plan's solver.window_steps)

    @property
    def rollout_gpus(self) -> dict[str, int]:
        gpus: dict[str, int] = {}
        for lane in self.lanes:
            gpus[lane.pool] = gpus.get(lane.pool, 0) + lane.count * lane.gpus_per_replica
        return gpus
