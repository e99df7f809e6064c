"""Wire the relay weight transport (``hex.transport: relay``) to the plan: which rollout workers form each pool
and how fast its links are. The transport itself lives in ``areal_hex_plugin.transport``."""

from __future__ import annotations

from dataclasses import asdict

from areal_hex_plugin.areal.placement import ROLLOUT_ROLE, TRAIN_ROLE, Placement
from areal_hex_plugin.specs.catalog import build_catalog
from areal_hex_plugin.specs.cluster import Cluster, build_cluster


def cluster_of(config) -> Cluster:
    """The recipe's cluster, built from the loaded ``hex:`` section."""
    catalog = build_catalog({name: asdict(figures) for name, figures in config.hex.gpu_catalog.items()})
    return build_cluster(config.hex.cluster, catalog)


def transport_settings(placement: Placement, cluster: Cluster):
    """One TransportPool per rollout pool: its workers (in the controller's order) and its links (GB/s)."""
    from areal_hex_plugin.transport.controller_adapter import TransportPool, TransportSettings

    train_pools = {s.pool for s in placement.slots[TRAIN_ROLE]}
    members: dict[str, list[int]] = {}
    for slot in placement.slots[ROLLOUT_ROLE]:
        members.setdefault(slot.pool, []).append(slot.index)
    pools = [
        TransportPool(
            name=pool,
            workers=workers,
            # The slowest link from any training machine to this pool bounds the first hop.
            cross_gb_per_s=min(cluster.link_gb_per_s(t, pool) for t in train_pools),
            intra_gb_per_s=cluster.pool(pool).inter_machine_gb_per_s,
        )
        for pool, workers in members.items()
    ]
    return TransportSettings(pools=pools)
