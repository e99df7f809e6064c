"""Wire the relay weight transport (``hex.transport: relay``) to the plan and the recipe: which rollout workers
form each pool, how fast its links are, and the ``hex.relay`` options. The transport itself lives in
``areal_hex_plugin.transport``."""

from __future__ import annotations

from areal_hex_plugin.areal.placement import ROLLOUT_ROLE, TRAIN_ROLE, Placement
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.config import RelayConfig


def with_servers(settings, slots, cluster: Cluster, train_slots):
    """``settings`` with the rollout servers of ``slots`` in their pools' ``TransportPool`` (a new pool's links:
    the slowest from any training machine to it, and its own between machines); changed in place, returned."""
    from areal_hex_plugin.transport.controller_adapter import TransportPool

    train_pools = {s.pool for s in train_slots}
    pools = {pool.name: pool for pool in settings.pools}
    for slot in slots:
        if slot.pool not in pools:
            pools[slot.pool] = TransportPool(
                name=slot.pool,
                workers=[],
                cross_gb_per_s=min(cluster.link_gb_per_s(t, slot.pool) for t in train_pools),
                intra_gb_per_s=cluster.pool(slot.pool).inter_machine_gb_per_s,
            )
            settings.pools.append(pools[slot.pool])
        pools[slot.pool].workers.append(slot.index)
    return settings


def transport_settings(placement: Placement, cluster: Cluster, relay: RelayConfig):
    """The controller's settings: one TransportPool per rollout pool (its workers in the controller's order and
    its links in GB/s), and the sender, receiver and commit options from ``hex.relay``."""
    from areal_hex_plugin.transport.controller_adapter import TransportSettings

    pools = with_servers(
        TransportSettings(), placement.slots[ROLLOUT_ROLE], cluster, placement.slots[TRAIN_ROLE]
    ).pools
    sender = {
        "backend": relay.backend,
        "timeout_s": relay.timeout_s,
        "chunk_bytes": relay.chunk_mb << 20,
        "on_failure": relay.on_failure,
        "max_resends": relay.max_resends,
    }
    receiver = {
        "timeout_s": relay.timeout_s,
        "allowed_hosts": list(relay.allowed_hosts),
        "bind_interface": relay.bind_interface,
        "stage_dir": relay.stage_dir,
        "rollback_dir": relay.rollback_dir,
    }
    return TransportSettings(
        pools=pools, sender=sender, receiver=receiver, min_committed_fraction=relay.min_committed_fraction
    )
