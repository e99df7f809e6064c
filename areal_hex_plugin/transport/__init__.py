"""Cross-GPU-type weight transport: topology-aware relay chains, bucketed, verified and versioned.

Imports are lazy: ``from areal_hex_plugin.transport import RelaySender`` loads torch only then, and the engine
adapters (which import upstream AReaL) only when they are asked for.
"""

from __future__ import annotations

from areal_hex_plugin.lazy_exports import lazy_exports

_EXPORTS = {
    "Endpoint": "route",
    "PoolRoute": "route",
    "Route": "route",
    "TransportError": "wire",
    "AuthError": "wire",
    "TOKEN_ENV": "wire",
    "load_token": "wire",
    "ReceiverNode": "node",
    "ReceiverConfig": "node",
    "WeightSink": "node",
    "RelaySender": "sender",
    "PartSender": "sender",
    "PartSummary": "sender",
    "SenderConfig": "sender",
    "UpdateReport": "sender",
    "MemorySink": "sinks",
    "TensorParallelSink": "sinks",
    "HexFSDPPPOActor": "fsdp_adapter",
    "RelayTrainSide": "train_side",
    "RelayReceiverMixin": "sglang_adapter",
    "SGLangDiskSink": "sglang_adapter",
    "HexPPOActorController": "controller_adapter",
    "TransportSettings": "controller_adapter",
    "TransportPool": "controller_adapter",
    "RelayWeightTransport": "registry",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
