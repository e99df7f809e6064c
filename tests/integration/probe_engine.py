"""A do-nothing upstream engine that reports where its worker process was placed (used by scheduler tests)."""

from __future__ import annotations

import os

from areal.api.engine_api import InferenceEngine


class PoolProbe(InferenceEngine):
    @property
    def initialized(self) -> bool:
        return True

    def whereami(self) -> dict[str, str]:
        report = {k: v for k, v in os.environ.items() if k.startswith("HEX_")}
        report["pid"] = str(os.getpid())
        try:
            import ray

            if ray.is_initialized():
                report["ray_node_id"] = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return report
