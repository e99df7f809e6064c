"""Worker-side engine and controller subclasses: per-GPU-type SGLang flags and share-weighted routing.

``HexRemoteSGLangEngine`` is upstream's ``RemoteSGLangEngine`` with a :class:`HexSGLangBackend` and the relay
transport's receiver methods; its ``as_controller`` returns a :class:`HexRolloutController`.
"""

from __future__ import annotations

import contextvars
import functools
import os
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from areal.engine.sglang_remote import RemoteSGLangEngine, SGLangBackend
from areal.infra.controller.rollout_controller import RolloutController
from areal.infra.remote_inf_engine import RemoteInfEngine

from areal_hex_plugin.areal.routing import ShareRouter
from areal_hex_plugin.areal.sglang_flags import server_args_for
from areal_hex_plugin.transport.sglang_adapter import RelayReceiverMixin

# The servers picked inside one routed call (submit or agenerate); released when that call ends.
_picks: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("hex_picks", default=None)
T = TypeVar("T")


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
        """The server for the next request; inside :meth:`_routed` it is released when the call ends, otherwise
        the caller releases it."""
        rank = self._router().choose()
        picks = _picks.get()
        if picks is not None:
            picks.append(rank)
        return self.workers[rank], rank

    async def _routed(self, call: Callable[[], Awaitable[T]], produced: Callable[[T], bool]) -> T:
        """Run ``call`` and release every server it picked, on every path: completed when ``produced(result)``,
        failed when it returns nothing, raises or is cancelled (an abort)."""
        picks: list[int] = []
        token = _picks.set(picks)
        ok = False
        try:
            result = await call()
            ok = produced(result)
            return result
        finally:
            _picks.reset(token)
            router = self._router()
            for rank in picks:
                router.release(rank, completed=ok)

    def _create_submit_callback(self, pending_task):
        submit = super()._create_submit_callback(pending_task)

        async def submit_and_release():
            # Upstream returns None for a rollout that failed, timed out or was rejected.
            return await self._routed(submit, lambda result: result is not None)

        return submit_and_release

    async def agenerate(self, req):
        return await self._routed(functools.partial(super().agenerate, req), lambda _: True)

    def export_stats(self) -> dict[str, float]:
        return {**super().export_stats(), **self.pool_sample_stats()}

    def pool_sample_stats(self) -> dict[str, float]:
        """Requests each pool completed and failed since the last export, as ``hex/rollout/<pool>/samples`` and
        ``hex/rollout/<pool>/failed``."""
        router = self._router()
        counts: dict[str, float] = defaultdict(float)
        for kind, per_server in (("samples", router.take_completed()), ("failed", router.take_failed())):
            for pool, n in zip(self._hex_pools, per_server, strict=True):
                counts[f"hex/rollout/{pool}/{kind}"] += n
        # The eval-rollout controller routes over the same servers; its counts must not replace training's.
        if self._worker_role != "rollout":
            return {}
        return dict(counts)


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
