"""Clusters rented by the GPU: whole machines of a pool, plus one machine holding the remainder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from areal_hex_plugin.specs.cluster import Cluster


def rent(cluster: Cluster, gpus: Mapping[str, int]) -> Cluster:
    """``cluster`` cut to ``gpus`` (GPU type -> count) of each type's first pool: full machines, and when the
    count is not a whole number of machines, a pool ``<name>-part`` of one machine with the rest (linked to its
    parent pool at the pool's own network speed). Types not listed, or with 0 GPUs, are dropped."""
    pools, links = [], dict(cluster.links)
    for gpu_type, count in gpus.items():
        if count <= 0:
            continue
        pool = next(p for p in cluster.pools if p.gpu_type == gpu_type)
        whole, rest = divmod(count, pool.gpus_per_machine)
        if whole:
            pools.append(replace(pool, machines=whole, hosts=pool.hosts[:whole]))
        if rest:
            part = replace(pool, name=f"{pool.name}-part", gpus_per_machine=rest, machines=1, hosts=())
            pools.append(part)
            if whole:
                links[tuple(sorted((pool.name, part.name)))] = pool.inter_machine_gb_per_s
            for (a, b), bw in cluster.links.items():
                if pool.name in (a, b):
                    other = b if a == pool.name else a
                    links[tuple(sorted((part.name, other)))] = bw
    return replace(cluster, pools=tuple(pools), links=links)
