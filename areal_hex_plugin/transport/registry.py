"""The relay in upstream's weight-transport registry (``areal.api.weight_transport``, ``patches/0003``): with the
patches applied, upstream's own trainer and FSDP actor run it under ``actor.weight_update_mode: hex_relay``, with
no plugin subclass of either. :func:`~areal_hex_plugin.areal.plugin.register` registers it when the installed
AReaL has the registry; without it, the driver's ``HexPPOTrainer`` runs the same relay through the shims
(``HexFSDPPPOActor``, ``HexPPOActorController``).

The protocol's three hooks, and what each does here:

- ``build_meta(trainer)``, in the trainer process once the rollout servers are up: start every server's receiver
  (upstream's engine RPC, so the rollout engine must be the plugin's, which ``register()`` installs with
  ``patches/0002``), make the route from the Hex scheduler's placement and ``hex.relay``, and put it in the meta's
  ``transport_options`` for the train workers;
- ``connect(train_engine, rollout_engine, meta)``, on every train rank: rank 0 builds the coordinating sender
  (:class:`~areal_hex_plugin.transport.train_side.RelayTrainSide`, bound to the engine by :class:`EngineRelay`);
- ``update_weights(train_engine, meta)``, on every train rank: upstream's gather loop with every rank sending the
  tensors it owns (``fsdp_adapter.send_version``), verified on every replica; then rank 0 commits (the second
  phase, which ``HexPPOActorController`` asks for as a call of its own) and refuses too few commits.

Megatron engines are not driven through the registry (the driver's ``HexMegatronRelayActor`` is). Nobody stops
the receivers at the end of such a run; each node removes its stage directory when its process ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from areal_hex_plugin.transport.fsdp_adapter import fsdp_part_index, fsdp_parts, send_version
from areal_hex_plugin.transport.train_side import RelayTrainSide

NAME = "hex_relay"


class EngineRelay(RelayTrainSide):
    """The relay's train-side seams for one of upstream's own FSDP engines (kept on it as ``_hex_relay``)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    @property
    def cpu_group(self):
        return self.engine.cpu_group

    def hex_parts(self) -> int:
        return fsdp_parts()

    def hex_part_index(self) -> int | None:
        return fsdp_part_index()


class RelayWeightTransport:
    """Upstream's ``WeightTransport`` protocol, implemented by the relay. ``settings_for(trainer)`` gives the
    relay's :class:`~areal_hex_plugin.transport.controller_adapter.TransportSettings` for upstream's trainer (the
    integration's, ``areal/transport_setup.py``: its Hex scheduler's placement and the run's cluster)."""

    def __init__(self, settings_for: Callable[[Any], Any]) -> None:
        self.settings_for = settings_for

    def build_meta(self, trainer) -> Any:
        from areal.api.io_struct import WeightUpdateMeta

        return WeightUpdateMeta(type=NAME, transport_options=self.meta_options(trainer))

    def meta_options(self, trainer) -> dict[str, Any]:
        """What the train workers need: the route through every rollout server's receiver (started now), the
        sender's options and the commit threshold."""
        from areal_hex_plugin.transport.controller_adapter import start_receivers, trainer_hosts

        settings = self.settings_for(trainer)
        route = start_receivers(trainer.rollout, settings, trainer_hosts(getattr(trainer, "actor", None)))
        return {
            "route": route.to_dict(),
            "sender": settings.sender,
            "replicas": route.replica_count,
            "min_committed_fraction": settings.min_committed_fraction,
        }

    def connect(self, train_engine, rollout_engine, meta) -> None:
        from areal.engine.fsdp_engine import FSDPEngine

        if not isinstance(train_engine, FSDPEngine):
            raise NotImplementedError(
                f"weight_update_mode={NAME} drives FSDP engines; a Megatron actor runs the relay through "
                "python -m areal_hex_plugin.driver (HexMegatronRelayActor)"
            )
        relay = getattr(train_engine, "_hex_relay", None) or EngineRelay(train_engine)
        train_engine._hex_relay = relay
        relay.hex_configure_transport(meta.transport_options["route"], meta.transport_options["sender"])

    def update_weights(self, train_engine, meta) -> None:
        import torch.distributed as dist

        from areal_hex_plugin.transport.controller_adapter import check_report

        relay = train_engine._hex_relay
        try:
            send_version(train_engine, relay, meta)  # send + verify: the replicas stage
        except Exception:
            relay.hex_abort()
            raise
        if dist.get_rank() == 0:  # every rank verified (send_version raises on all together otherwise)
            options = meta.transport_options
            check_report(relay.hex_commit(), options["replicas"], options["min_committed_fraction"])
