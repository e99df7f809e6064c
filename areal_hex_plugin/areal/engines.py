"""Worker-side engine and controller subclasses: per-GPU-type SGLang flags and share-weighted routing.

``HexRemoteSGLangEngine`` is upstream's ``RemoteSGLangEngine`` with a :class:`HexSGLangBackend` and the relay
transport's receiver methods; its ``as_controller`` returns a :class:`HexRolloutController`.
"""

from __future__ import annotations

import contextvars
import os
from collections import defaultdict
from typing import Any

from areal.engine.sglang_remote import RemoteSGLangEngine, SGLangBackend
from areal.infra.controller.rollout_controller import RolloutController
from areal.infra.remote_inf_engine import RemoteInfEngine

from areal_hex_plugin.areal.routing import ShareRouter
from areal_hex_plugin.areal.sglang_flags import server_args_for
from areal_hex_plugin.transport.sglang_adapter import RelayReceiverMixin

_chosen_rank: contextvars.ContextVar[int | None] = contextvars.ContextVar("hex_chosen_rank", default=None)


class HexSGLangBackend(SGLangBackend):
    """Launches the server with flags for the GPU type this worker was placed on (``HEX_GPU_TYPE``)."""

    def launch_server(self, server_args: dict[str, Any]):
        gpu_type = os.environ.get("HEX_GPU_TYPE")
        if gpu_type:
            from areal_hex_plugin.specs.catalog import build_catalog

            catalog = build_catalog()
            # A type the recipe added under hex.gpu_catalog is unknown here: keep the recipe's memory fraction.
            hbm_gb = catalog.get(gpu_type).hbm_gb if gpu_type in catalog else None
            server_args = server_args_for(gpu_type, hbm_gb, server_args)
        return super().launch_server(server_args)


class HexRolloutController(RolloutController):
    """Routes each rollout to a server by the plan's shares instead of round-robin; counts completions per pool."""

    def _router(self) -> ShareRouter:
        router = getattr(self, "_hex_router", None)
        if router is None or len(router.shares) != len(self.workers):
            # eval-rollout reuses the rollout servers, so it follows the rollout slots.
            placement = self.scheduler.placement
            slots = placement.for_role(self._worker_role) or placement.for_role("rollout")
            self._hex_pools = [s.pool for s in slots]
            router = self._hex_router = ShareRouter([s.share for s in slots], placement.routing)
        return router

    def _choose_worker(self):
        rank = self._router().choose()
        _chosen_rank.set(rank)
        return self.workers[rank], rank

    def _create_submit_callback(self, pending_task):
        submit = super()._create_submit_callback(pending_task)

        async def submit_and_release():
            try:
                return await submit()
            finally:
                rank = _chosen_rank.get()
                if rank is not None:
                    self._router().release(rank)

        return submit_and_release

    def export_stats(self) -> dict[str, float]:
        return {**super().export_stats(), **self.pool_sample_stats()}

    def pool_sample_stats(self) -> dict[str, float]:
        """Samples each pool finished since the last export, as ``hex/rollout/<pool>/samples``."""
        per_pool: dict[str, float] = defaultdict(float)
        done_per_server = self._router().take_completed()
        for pool, done in zip(self._hex_pools, done_per_server, strict=True):
            per_pool[pool] += done
        # The eval-rollout controller routes over the same servers; its counts must not replace training's.
        if self._worker_role != "rollout":
            return {}
        return {f"hex/rollout/{pool}/samples": n for pool, n in per_pool.items()}


class HexRemoteSGLangEngine(RelayReceiverMixin, RemoteSGLangEngine):
    """Per-GPU-type server flags, share routing, and the relay transport's receiver methods (``hex_*``)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._engine = RemoteInfEngine(config, HexSGLangBackend())

    @classmethod
    def as_controller(cls, config, scheduler):
        if config._version == "v2":
            return super().as_controller(config, scheduler)
        return HexRolloutController(cls, config=config, scheduler=scheduler)
