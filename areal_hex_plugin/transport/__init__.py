"""Cross-GPU-type weight transport: topology-aware relay chains, bucketed, verified and versioned.

Imports are lazy: ``from areal_hex_plugin.transport import RelaySender`` loads torch only then, and the engine
adapters (which import upstream AReaL) only when they are asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
