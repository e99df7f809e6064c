"""Wire the relay weight transport (``hex.transport: relay``) to the plan and the recipe: which rollout workers
form each pool, how fast its links are, and the ``hex.relay`` options; and re-route it to the servers an elastic
run keeps (:func:`reroute`). The transport itself lives in ``areal_hex_plugin.transport``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

from areal.utils import logging

from areal_hex_plugin.areal.worker_slots import ROLLOUT_ROLE, TRAIN_ROLE, Placement
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.config import RelayConfig

logger = logging.getLogger("HexTransport")


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


def relay_weight_transport():
    """The relay as upstream's weight-transport registry takes it (``patches/0003``; :func:`plugin.register`)."""
    from areal_hex_plugin.transport.registry import RelayWeightTransport

    return RelayWeightTransport(trainer_transport_settings)


def trainer_transport_settings(trainer):
    """The relay's settings for a trainer upstream built: its Hex scheduler's placement, the run's cluster."""
    from areal_hex_plugin.areal.session import session_for
    from areal_hex_plugin.transport.registry import NAME

    placement = getattr(trainer.scheduler, "placement", None)
    if placement is None or not hasattr(trainer.config, "hex"):
        raise ValueError(
            f"weight_update_mode={NAME} needs a Hex scheduler (scheduler.type: hex_local, hex_ray or "
            "hex_slurm) and a config with a hex: section (HexGRPOConfig)"
        )
    cluster = session_for(trainer.config, NAME).recipe.cluster
    return transport_settings(placement, cluster, trainer.config.hex.relay)


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


def reroute(actor, rollout, reachable: Sequence[bool]) -> None:
    """Point the relay at the ``reachable`` rollout servers only (before an update): each one's receiver (started
    once, so the same endpoint), the plan's pools, and the train workers' coordinator rebuilt through the
    transport's ``hex_configure_transport``. Nothing to do on upstream's own weight path."""
    from areal.infra.utils.concurrent import run_async_task

    from areal_hex_plugin.transport.controller_adapter import receiver_options, trainer_hosts
    from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route

    settings = getattr(actor, "hex_settings", None)
    if settings is None or not settings.pools:
        return
    ranks = [rank for rank, ok in enumerate(reachable) if ok]
    # A receiver first started here (a server lost before the first update) takes control from the trainer only.
    options = receiver_options(settings, trainer_hosts(actor))

    async def start_all() -> list[str]:
        return await asyncio.gather(
            *(
                rollout.scheduler.async_call_engine(
                    rollout.workers[rank].id,
                    "hex_start_receiver",
                    engine_name=rollout._engine_name(rank),
                    **options,
                )
                for rank in ranks
            )
        )

    endpoints = dict(zip(ranks, (Endpoint.parse(text) for text in run_async_task(start_all)), strict=True))
    route = Route(
        [
            PoolRoute(
                pool.name, [endpoints[i] for i in pool.workers], pool.cross_gb_per_s, pool.intra_gb_per_s
            )
            for pool in (replace(p, workers=[i for i in p.workers if i in endpoints]) for p in settings.pools)
            if pool.workers
        ]
    )
    actor._hex_route = route
    actor.hex_ranks = {str(endpoint): rank for rank, endpoint in endpoints.items()}
    actor._custom_function_call("hex_configure_transport", route.to_dict(), settings.sender)
    logger.info(f"relay route now {route.replica_count} servers: {route.to_dict()}")
