"""The one entry point the scheduler uses: :class:`CostModel`, pure and memoised per configuration."""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Mapping, Sequence

from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.costmodel.lengths import LengthStats, length_stats
from areal_hex_plugin.costmodel.rollout import RolloutEstimate, RolloutStage, estimate_rollout
from areal_hex_plugin.costmodel.train import TrainEstimate, TrainStage, estimate_train
from areal_hex_plugin.costmodel.weightsync import WeightSyncEstimate, estimate_weight_sync, sender_bytes
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.workload import WorkloadSpec


def admission_room(eta: int, window: int, batches: float) -> float:
    """Consumer batches of rollouts that admission lets replace those ending during the last training step of a
    weight-update ``window`` with ``batches`` in flight: the room, eta + 1 batches after an update, shrinks by one
    with each batch the window consumes, and a rollout that ends while the trainer trains stays accepted (it
    counts against the room) until the next batch is taken."""
    return eta + 1 - window - batches


def tight_step_s(rollout_s: float, train_s: float, batches: float, room: float) -> float:
    """One step whose training lets admission replace only ``room`` (< 1) batches of the rollouts that end
    meanwhile, the fleet taking ``rollout_s`` per batch at full occupancy with ``batches`` in flight: training,
    then the wait for what the batch still lacks. Until ``room`` batches have ended, every rollout that ends is
    replaced; then the rollouts in flight decay unreplaced, each with the fleet's mean residence (Little's law:
    ``batches * rollout_s``) as its expected remaining time; after the update the rest comes at full speed."""
    g, m = rollout_s, batches
    free = min(train_s, max(0.0, room) * g)
    done = free / g + m * (1 - math.exp(-(train_s - free) / (m * g)))
    return train_s + max(0.0, 1 - done) * g


class CostModel:
    """Cost estimates for one cluster and workload; every result is a frozen dataclass, cached by its inputs."""

    def __init__(
        self,
        cluster: Cluster,
        workload: WorkloadSpec,
        calibration: Calibration | None = None,
        lengths: LengthStats | None = None,  # the workload's (computed when not given)
    ) -> None:
        self.workload = workload
        self.calibration = calibration or Calibration()
        # The cluster as its catalog describes it; the model computes with the calibration's figures in place.
        self.catalog_cluster = cluster
        self.cluster = self.calibration.on(cluster)
        self._lengths = lengths or length_stats(
            workload.output_lengths, workload.rl.n_samples, workload.rl.samples_per_step
        )
        self._rollout: dict[tuple[tuple[RolloutStage, ...], int | None], RolloutEstimate] = {}
        self._train: dict[tuple[TrainStage, ...], TrainEstimate] = {}
        self._train_stages: dict = {}  # stage costs shared by the layouts (costmodel/train.py)
        self._sync: dict[tuple, WeightSyncEstimate] = {}

    def batch_work_s(self, tokens_per_s: float, concurrency: int) -> float:
        """Seconds a full batch of ``concurrency`` sequences in flight still decodes at ``tokens_per_s`` (each at
        the mean in-flight position, ``LengthStats.inflight_position``)."""
        return concurrency * self._lengths.inflight_position / tokens_per_s

    def at_eta(self, eta: int) -> CostModel:
        """This model under the staleness bound ``eta``: it reads this one's estimates that eta does not change
        (a replica's estimate depends on eta only through its in-flight cap, part of its key) and keeps those it
        computes apart, so using it never changes this one."""
        cm = CostModel(self.catalog_cluster, self.workload.at_eta(eta), self.calibration)
        cm._rollout, cm._train, cm._train_stages, cm._sync = (
            ChainMap({}, m) for m in (self._rollout, self._train, self._train_stages, self._sync)
        )
        return cm

    def with_calibration(self, calibration: Calibration) -> CostModel:
        """This cluster and workload under another calibration (the workload's length statistics reused)."""
        return CostModel(self.catalog_cluster, self.workload, calibration, self._lengths)

    @property
    def estimates(self) -> int:
        """Estimates computed so far (not those answered from the memo)."""
        return len(self._rollout) + len(self._train) + len(self._sync)

    def prompts_to_fill(self, sequences: int) -> int:
        """Rollouts upstream must admit (``max_concurrent_rollouts``) to keep ``sequences`` decoding: each holds
        its slot until the longest of its ``n_samples`` samples ends, while its finished samples free their KV."""
        return math.ceil(sequences / self.workload.rl.n_samples * self._lengths.group_hold)

    def batches_in_flight(self, sequences: int) -> float:
        """Consumer batches of rollouts upstream admits to keep ``sequences`` decoding (:meth:`prompts_to_fill`)."""
        return self.batches_admitted(self.prompts_to_fill(sequences))

    def batches_admitted(self, prompts: int) -> float:
        """Consumer batches of rollouts in flight when upstream admits ``prompts`` at once (at most
        ``rl.max_admitted`` where set)."""
        rl = self.workload.rl
        return min(prompts, rl.max_admitted or prompts) / rl.consumer_batch_size

    def rollout(self, stages: tuple[RolloutStage, ...], max_sequences: int | None = None) -> RolloutEstimate:
        """One rollout replica: ``len(stages)`` pipeline stages, each TP inside one machine, with at most
        ``max_sequences`` in flight (None: as many as memory and the engine's batch limit allow)."""
        key = (tuple(stages), max_sequences)
        found = self._rollout.get(key)
        if found is None:
            found = estimate_rollout(
                self.cluster, self.workload, self.calibration, self._lengths, key[0], max_sequences
            )
            self._rollout[key] = found
        return found

    def staleness_sequences(self, batches: int | None = None) -> int:
        """Sequences the staleness bound lets upstream keep in flight: ``batches`` consumer batches of rollouts
        (default eta + 1, weights pushed every step; at most ``rl.max_admitted`` rollouts where set), each rollout
        holding its slot until its longest sample ends."""
        rl = self.workload.rl
        batches = rl.max_head_offpolicyness + 1 if batches is None else batches
        prompts = batches * rl.consumer_batch_size
        if rl.max_admitted:
            prompts = min(prompts, rl.max_admitted)
        return max(1, int(prompts * rl.n_samples / self._lengths.group_hold))

    def train(self, stages: tuple[TrainStage, ...]) -> TrainEstimate:
        """One training layout: ``len(stages)`` pipeline stages, each DP x TP GPUs of one pool."""
        stages = tuple(stages)
        found = self._train.get(stages)
        if found is None:
            found = estimate_train(
                self.cluster, self.workload, self.calibration, stages, memo=self._train_stages
            )
            self._train[stages] = found
        return found

    def senders(self, stages: Sequence[TrainStage]) -> dict[str, float]:
        """Bytes of a weight version each pool of a feasible training layout sends (its stages' layers)."""
        layers = self.train(tuple(stages)).layers
        return sender_bytes(self.workload.model, [s.pool for s in stages], layers)

    def weight_sync(
        self,
        senders: Mapping[str, float],
        replicas: Sequence[tuple[tuple[RolloutStage, ...], int]],
        strategy: str = "broadcast",
        colocated: tuple[str, ...] = (),
    ) -> WeightSyncEstimate:
        """One weight version from the training pools (pool -> bytes its stages hold, :meth:`senders`) to every
        replica ((stages, count) pairs) and to the rollout GPUs of the ``colocated`` pools' shared machines."""
        key = (
            tuple(sorted(senders.items())),
            tuple(sorted((tuple(s), n) for s, n in replicas)),
            strategy,
            tuple(sorted(colocated)),
        )
        found = self._sync.get(key)
        if found is None:
            found = estimate_weight_sync(
                self.cluster, self.workload, self.calibration, senders, replicas, strategy, colocated
            )
            self._sync[key] = found
        return found

    def reward_s(self, samples: int) -> float:
        """Seconds to score ``samples`` rollouts on the recipe's reward CPUs."""
        return samples * self.workload.reward_cpu_s_per_sample / self.workload.reward_cpus
