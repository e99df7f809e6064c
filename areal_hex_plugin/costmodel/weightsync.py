"""Weight-sync model: seconds to move one bf16 weight version from the trainer to every rollout replica.

Every training pipeline stage sends the layers it holds, from the pool it runs on (areal 1.0.4
``engine/fsdp_engine.py`` ``_update_weights_from_distributed``: rank 0 of each stage broadcasts bucket after bucket
of ``weight_chunked_mem_mb`` into one NCCL group with every rollout GPU; the Megatron engine does the same per
pipeline stage). A version costs, for each sending pool's bytes ``b``:

* the network: NCCL broadcasts a bucket as a pipelined chain through the receiving machines (each machine
  receives every chunk once and forwards it while the next arrives), so the chain moves at its slowest link and
  adds one chunk's time per extra hop, not one whole copy per receiving machine. ``relay`` (our transport) sends
  one copy per rollout pool to a relay machine, which forwards it down a chain inside its pool;
* the endpoints: a GPU gathers (trainer: FSDP ``full_tensor`` per parameter) or loads (engine:
  ``update_weights_from_distributed`` per bucket) the version at its type's ``update_gb_per_s``; half of ``b``'s
  time is charged at the sender's rate and half at the slowest receiver's, which for one GPU type is ``b`` at
  that type's rate;
* once per update, the fixed ``update_fixed_s`` of the slowest type involved (pause, group rendezvous, HTTP round
  trips, cache flush, resume).

Stages send one after another: every byte enters each receiving machine through the same inbound link.

Rollout GPUs on a machine shared with training (``colocated``: upstream's ``sglang.d4+fsdp.d4`` on one node) take
the version from the training GPUs beside them over the machine's GPU links (:func:`links.gpu_link`), no network
hop, while the network carries it to the other rollout machines: the sending pool's copy costs the slower of
the two.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.costmodel.links import gpu_link, network
from areal_hex_plugin.costmodel.memory import GB, stage_params
from areal_hex_plugin.costmodel.rollout import RolloutStage
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.models import ModelShape
from areal_hex_plugin.specs.workload import WorkloadSpec

STRATEGIES = ("broadcast", "relay")
# NCCL's pipelining unit on a broadcast chain (NCCL_BUFFSIZE default 4 MiB) and the relay's forwarding unit
# (upstream's ``weight_chunked_mem_mb`` default bucket).
NCCL_CHUNK_BYTES = 4 * 2**20
BUCKET_BYTES = 1024 * 2**20


def strategy_for(transport: str) -> str:
    """The sync model of a recipe's ``hex.transport``: our relay, or upstream's per-stage broadcast."""
    return "relay" if transport == "relay" else "broadcast"


@dataclass(frozen=True)
class WeightSyncEstimate:
    seconds: float
    bytes: int  # one weight version (bf16)
    bottleneck: str  # the link or step that dominates


def sender_bytes(model: ModelShape, pools: Sequence[str], layers: Sequence[int]) -> dict[str, float]:
    """bf16 bytes of one weight version each training pool sends: the layers of its pipeline stages
    (``pools[i]`` holds stage i with ``layers[i]`` layers)."""
    out: dict[str, float] = {}
    for pool, params in zip(pools, stage_params(model, tuple(layers)), strict=True):
        out[pool] = out.get(pool, 0.0) + params * 2.0
    return out


def receiving_machines(
    cluster: Cluster, replicas: Sequence[tuple[tuple[RolloutStage, ...], int]]
) -> dict[str, int]:
    """Machines per pool that hold rollout GPUs, with replicas packed onto as few machines as possible."""
    gpus: dict[str, int] = {}
    for stages, count in replicas:
        for s in stages:
            gpus[s.pool] = gpus.get(s.pool, 0) + s.tp * count
    return {name: math.ceil(n / cluster.pool(name).gpus_per_machine) for name, n in gpus.items() if n > 0}


def _broadcast_s(cluster: Cluster, sender: str, machines: Mapping[str, int], size: float) -> float:
    """One pipelined NCCL chain from ``sender`` through every receiving machine: the slowest link moves
    ``size``; each further hop adds one chunk."""
    links = [network(cluster, sender, pool) for pool in machines]
    pools = sorted(machines)
    links += [network(cluster, a, b) for a, b in pairwise(pools)]
    hops = sum(machines.values())
    slowest = min(links)
    return size / slowest + (hops - 1) * NCCL_CHUNK_BYTES / slowest


def _relay_s(cluster: Cluster, sender: str, machines: Mapping[str, int], size: float) -> float:
    """One copy per rollout pool from ``sender``, then a bucket-pipelined chain inside each pool."""
    root = sum(size / network(cluster, sender, pool) for pool in machines)
    chains = [
        (n - 1) * min(size, BUCKET_BYTES) / network(cluster, pool, pool) for pool, n in machines.items()
    ]
    fill = min(size, BUCKET_BYTES) / min(network(cluster, sender, pool) for pool in machines)
    return max(root, max(chains)) + fill


def estimate_weight_sync(
    cluster: Cluster,
    workload: WorkloadSpec,
    calibration: Calibration,
    senders: Mapping[str, float],
    replicas: Sequence[tuple[tuple[RolloutStage, ...], int]],
    strategy: str,
    colocated: Sequence[str] = (),
) -> WeightSyncEstimate:
    """Seconds for one weight version to reach every replica's machines, ``senders`` giving the bytes each
    training pool holds (:func:`sender_bytes`); ``colocated``: the pools whose shared machine (training beside
    rollout) also receives, over its GPU links (``replicas`` are the rest)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown weight-sync strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    size = workload.model.weight_bytes()
    machines = receiving_machines(cluster, replicas)
    senders = {pool: b for pool, b in senders.items() if b > 0}
    receivers = {*machines, *colocated}
    if not receivers or not senders:
        return WeightSyncEstimate(0.0, size, "nothing to send")

    def eff(pool: str):
        return calibration.for_gpu(cluster.pool(pool).gpu_type)

    slowest_receiver = min(eff(p).update_gb_per_s for p in receivers) * GB
    fixed = max(eff(p).update_fixed_s for p in (*senders, *receivers))
    move = _relay_s if strategy == "relay" else _broadcast_s

    def copy_s(pool: str, b: float) -> float:
        # A sender's bytes reach a shared machine's rollout GPUs only from its own pool's training part.
        nvlink = b / gpu_link(cluster.pool(pool), calibration) if pool in colocated else 0.0
        remote = [p for p in colocated if p != pool]
        hops = {**machines, **{p: machines.get(p, 0) + 1 for p in remote}}
        return max(move(cluster, pool, hops, b) if hops else 0.0, nvlink)

    network_s = sum(copy_s(pool, b) for pool, b in senders.items())
    endpoint_s = sum(
        b / 2 / (eff(pool).update_gb_per_s * GB) + b / 2 / slowest_receiver for pool, b in senders.items()
    )
    parts = {"network": network_s, "gather and load": endpoint_s, "fixed per update": fixed}
    worst = max(parts, key=parts.__getitem__)
    links = ", ".join(
        f"{pool}->{dst} {cluster.link_gb_per_s(pool, dst):g} GB/s"
        for pool in sorted(senders)
        for dst in sorted(machines)
    )
    links += "".join(f"{', ' if links else ''}{pool} shared machine: GPU links" for pool in sorted(colocated))
    bottleneck = f"{worst} ({parts[worst]:.1f} s of {sum(parts.values()):.1f} s; {links})"
    return WeightSyncEstimate(sum(parts.values()), size, bottleneck)
