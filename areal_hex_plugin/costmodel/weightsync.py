"""Weight-sync model: seconds to move one bf16 weight version from the trainer to every rollout replica.

* ``broadcast`` (what upstream ``xccl`` and the paper do): trainer rank 0 is the one root. Its machine's NIC
  carries every bucket once to every receiving machine, one after another (GPUs inside a machine share the
  copy over their GPU link). Matches the paper's Table 2 scaling: time grows with the number of rollout machines.
* ``relay`` (our transport): the root sends each bucket once per rollout pool, to one relay machine there; the
  relays forward it along a chain of their pool's machines. Buckets pipeline, so the chain costs one bucket's
  transfer per extra hop on top of the slowest link's full transfer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from areal_hex_plugin.costmodel.links import network
from areal_hex_plugin.costmodel.memory import GB
from areal_hex_plugin.costmodel.rollout import RolloutStage
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.workload import WorkloadSpec

STRATEGIES = ("broadcast", "relay")


def strategy_for(transport: str) -> str:
    """The sync model of a recipe's ``hex.transport``: our relay, or upstream's single-root broadcast."""
    return "relay" if transport == "relay" else "broadcast"


# Upstream's ``weight_chunked_mem_mb`` default; each bucket costs a gather on the trainer, a rendezvous and a
# load into the engine, which this fixed time per bucket stands for.
BUCKET_BYTES = 1024 * 1024 * 1024
BUCKET_OVERHEAD_S = 0.05


@dataclass(frozen=True)
class WeightSyncEstimate:
    seconds: float
    bytes: int  # one weight version (bf16)
    bottleneck: str  # the link or step that dominates


def _receiving_machines(
    cluster: Cluster, replicas: Sequence[tuple[tuple[RolloutStage, ...], int]]
) -> dict[str, int]:
    """Machines per pool that hold rollout GPUs, with replicas packed onto as few machines as possible."""
    gpus: dict[str, int] = {}
    for stages, count in replicas:
        for s in stages:
            gpus[s.pool] = gpus.get(s.pool, 0) + s.tp * count
    return {name: math.ceil(n / cluster.pool(name).gpus_per_machine) for name, n in gpus.items() if n > 0}


def estimate_weight_sync(
    cluster: Cluster,
    workload: WorkloadSpec,
    train_gpus: Mapping[str, int],
    replicas: Sequence[tuple[tuple[RolloutStage, ...], int]],
    strategy: str,
) -> WeightSyncEstimate:
    """Seconds for one weight version to reach every replica's machines; the root is the largest trainer pool."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown weight-sync strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    size = workload.model.weight_bytes()
    machines = _receiving_machines(cluster, replicas)
    if not machines or not train_gpus:
        return WeightSyncEstimate(0.0, size, "nothing to send")
    root = max(sorted(train_gpus), key=lambda name: train_gpus[name])
    buckets = math.ceil(size / BUCKET_BYTES)
    overhead = buckets * BUCKET_OVERHEAD_S

    def link(pool: str) -> float:
        return network(cluster, root, pool)

    if strategy == "broadcast":
        sends = {pool: n * size / link(pool) for pool, n in machines.items()}
        seconds = sum(sends.values()) + overhead
        worst = max(sends, key=sends.__getitem__)
        bottleneck = (
            f"root NIC: {sum(machines.values())} sends of {size / GB:.1f} GB, "
            f"{machines[worst]} over {root}->{worst} at {cluster.link_gb_per_s(root, worst):g} GB/s"
        )
        return WeightSyncEstimate(seconds, size, bottleneck)

    # relay: the root's NIC sends one copy per pool; each pool's chain forwards bucket by bucket.
    root_nic = sum(size / link(pool) for pool in machines)
    chains = {}
    for pool, n in machines.items():
        inner = network(cluster, pool, pool)
        chains[pool] = (size / inner if n > 1 else 0.0) + (n - 1) * min(size, BUCKET_BYTES) / inner
    slowest_chain = max(chains, key=chains.__getitem__)
    # Pipelining overlaps the root's sends with the chains; the first bucket's trip is the fill latency.
    fill = min(size, BUCKET_BYTES) / min(link(p) for p in machines)
    if root_nic >= chains[slowest_chain]:
        seconds = root_nic + fill
        bottleneck = f"root NIC: one copy per pool ({', '.join(sorted(machines))})"
    else:
        seconds = chains[slowest_chain] + fill
        bottleneck = f"relay chain in pool {slowest_chain} ({machines[slowest_chain]} machines)"
    return WeightSyncEstimate(seconds + overhead, size, bottleneck)
