"""The rollout engine and controller subclasses: one layout per replica group, share-weighted routing.

``HexRemoteSGLangEngine`` is upstream's ``RemoteSGLangEngine`` with the relay transport's receiver methods; its
``as_controller`` returns a :class:`HexRolloutController`, which starts every server with its own GPU count and
``server_args`` (the replica group's TP/PP, planned concurrency and GPU-type flags, computed by the rewrite).
Its :class:`HexSGLangBackend` starts the ``HEX_SGLANG_SERVER_MODULE`` module in place of SGLang where a worker
sets it (CPU test runs).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from areal.api.cli_args import SchedulingSpec
from areal.engine.sglang_remote import RemoteSGLangEngine, SGLangBackend
from areal.infra.controller.rollout_controller import RolloutController
from areal.infra.remote_inf_engine import RemoteInfEngine
from areal.utils import logging

from areal_hex_plugin.areal.routing import ShareRouter
from areal_hex_plugin.areal.worker_slots import ROLLOUT_ROLE
from areal_hex_plugin.fast_exit import freeze_heap_at_exit
from areal_hex_plugin.transport.sglang_adapter import RelayReceiverMixin

# A rollout worker env var (set it in the recipe's rollout scheduling_spec env_vars): the Python module to run as
# the inference server instead of upstream's SGLang launcher, given the same command-line flags. CPU test runs
# point it at an SGLang-API stand-in (tests/e2e/sglang_server.py); unset on real clusters.
SERVER_MODULE_ENV = "HEX_SGLANG_SERVER_MODULE"

# The servers picked inside one routed call (submit or agenerate); released when that call ends.
_picks: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("hex_picks", default=None)
T = TypeVar("T")
logger = logging.getLogger("HexRolloutController")


def per_server_specs(job_tasks: list[SchedulingSpec], instance_size: int, slots) -> list[SchedulingSpec]:
    """One spec per planned server: upstream's spec (scaled by its one ``instance_size``) rescaled to the slot's
    own ``tp*pp`` GPUs, CPUs and memory."""
    out = []
    for spec, slot in zip(job_tasks, slots, strict=True):
        size = slot.tp * slot.pp
        out.append(
            replace(
                spec,
                cpu=spec.cpu // instance_size * size,
                mem=spec.mem // instance_size * size,
                gpu=size if spec.gpu > 0 else 0,
            )
        )
    return out


class HexSGLangBackend(SGLangBackend):
    """Upstream's SGLang backend; a worker with ``HEX_SGLANG_SERVER_MODULE`` starts that module instead, with the
    same SGLang flags."""

    def launch_server(self, server_args: dict[str, Any]):
        module = os.environ.get(SERVER_MODULE_ENV)
        if not module:
            return super().launch_server(server_args)
        from areal.api.cli_args import SGLangConfig

        cmd = SGLangConfig.build_cmd_from_args(server_args)
        cmd[:3] = [sys.executable, "-m", module]  # the flags stay SGLang's
        return subprocess.Popen(cmd, stdout=sys.stdout, stderr=sys.stdout)


class HexRolloutController(RolloutController):
    """Starts each planned server with its own layout and flags, routes rollouts by the plan's shares instead of
    round-robin, and counts completions per pool. With ``hex_elastic`` (``areal/elastic/``, attached by the
    trainer) it resubmits the samples of a lost server, skips lost servers in control calls and relaunches them."""

    hex_elastic = None  # ElasticRollout, once attached
    _hex_lock = threading.Lock()  # servers attached (a machine that joined) against the per-pool counts

    @property
    def staleness_manager(self):
        inner = self._staleness_manager
        return inner if self.hex_elastic is None else self.hex_elastic.manager(inner)

    def _slots(self):
        # eval-rollout reuses the rollout servers, so it follows the rollout slots.
        placement = self.scheduler.placement
        return placement.for_role(self._worker_role) or placement.for_role("rollout")

    async def _async_initialize(self, job, server_args, server_infos=None, *args, **kwargs):
        if server_infos is None and job.tasks and job.tasks[0].gpu > 0:
            parallel = self.rollout_alloc.parallel
            job = replace(
                job, tasks=per_server_specs(job.tasks, parallel.tp_size * parallel.pp_size, self._slots())
            )
        return await super()._async_initialize(job, server_args, server_infos, *args, **kwargs)

    async def _collective_rpc_async(self, method: str, *args, **kwargs):
        if method != "launch_server" or kwargs.get("server_args") is None:
            return await super()._collective_rpc_async(method, *args, **kwargs)
        base = self._hex_server_args = kwargs.pop("server_args")
        slots = self._slots()
        return await asyncio.gather(
            *(
                self.scheduler.async_call_engine(
                    *args,
                    worker_id=worker.id,
                    method=method,
                    engine_name=self._engine_name(rank),
                    server_args=slot.launch_args(base),
                    **kwargs,
                )
                for rank, (worker, slot) in enumerate(zip(self.workers, slots, strict=True))
            )
        )

    async def _generic_collective_rpc_async(self, method, workers, engine_name_fn, *args, **kwargs):
        elastic = self.hex_elastic
        if elastic is None or workers is not self.workers:
            return await super()._generic_collective_rpc_async(
                method, workers, engine_name_fn, *args, **kwargs
            )
        ranks = [
            rank for rank in range(len(workers)) if elastic.reachable(rank)
        ]  # a lost server answers nothing
        answers = await asyncio.gather(
            *(
                self.scheduler.async_call_engine(
                    *args,
                    worker_id=workers[rank].id,
                    method=method,
                    engine_name=engine_name_fn(rank),
                    **kwargs,
                )
                for rank in ranks
            ),
            return_exceptions=True,
        )
        # A server that died since the watcher's last round fails the call: confirmed lost, it is left out and
        # the call holds on the others (a pause that failed on training rank 0 left the other ranks at a barrier).
        for rank, answer in zip(ranks, answers, strict=True):
            if isinstance(answer, BaseException) and not await asyncio.to_thread(
                elastic.confirm_failure, rank
            ):
                raise answer
        return [answer for answer in answers if not isinstance(answer, BaseException)]

    def hex_relaunch(self, rank: int) -> str:
        """Start server ``rank`` again on its worker, with its layout and flags; its new ``host:port``."""
        from areal.api import LocalInfServerInfo
        from areal.infra.utils.concurrent import run_async_task

        answer = run_async_task(
            self.scheduler.async_call_engine,
            self.workers[rank].id,
            "hex_relaunch_server",
            engine_name=self._engine_name(rank),
            server_args=self._slots()[rank].launch_args(self._hex_server_args),
        )
        self.server_infos[rank] = LocalInfServerInfo(host=answer["host"], port=answer["port"], process=None)
        return f"{answer['host']}:{answer['port']}"

    def hex_follow(self, rank: int, address: str) -> None:
        """Send this controller's requests for server ``rank`` to ``address`` (``host:port``): the eval-rollout
        controller following a server the training one relaunched (:meth:`hex_relaunch`)."""
        from areal.infra.utils.concurrent import run_async_task

        run_async_task(
            self.scheduler.async_call_engine,
            self.workers[rank].id,
            "hex_follow_server",
            engine_name=self._engine_name(rank),
            addr=address,
        )

    def hex_route_like(self, shares: Sequence[float]) -> None:
        """Route by the training controller's ``shares`` over the servers this controller has (eval-rollout's:
        a lost or retired server gets none; a server that joined once its eval worker is attached). Kept as it
        is where none of them has a share."""
        own = list(shares[: len(self.workers)])
        if any(share > 0 for share in own):
            self._router().set_shares(own)

    def hex_in_flight(self, rank: int) -> int:
        """The requests this controller has at server ``rank`` now (0 for a server it does not route to)."""
        outstanding = self._router().outstanding
        return outstanding[rank] if rank < len(outstanding) else 0

    def hex_stop_server(self, rank: int) -> None:
        """Stop server ``rank`` on its worker (upstream's ``teardown_server``): its GPUs are free, its worker idles
        until the run ends (a live re-layout, ``areal/elastic/relayout.py``)."""
        from areal.infra.utils.concurrent import run_async_task

        run_async_task(
            self.scheduler.async_call_engine,
            self.workers[rank].id,
            "teardown_server",
            engine_name=self._engine_name(rank),
        )

    def hex_start_servers(self, slots, role: str) -> tuple[list, list]:
        """Start a worker, its engine and its server for each of ``slots`` (a machine that joins or is laid out
        anew; ranks ``slot.index`` on), under the scheduler role ``role``: their workers and server infos, not yet routed to
        (:meth:`hex_attach`)."""
        from areal.api import Job
        from areal.infra.utils.concurrent import run_async_task

        placement = self.scheduler.placement
        self.scheduler.placement = replace(placement, slots={**placement.slots, role: tuple(slots)})
        spec = self.config.scheduling_spec[0]
        job = Job(
            replicas=len(slots),
            tasks=per_server_specs([spec] * len(slots), 1, slots),
            scheduling_strategy=self.config.scheduling_strategy,
            role=role,
        )

        async def start():
            workers = await self._hex_workers_with_engines(job, slots)
            pairs = list(zip(workers, slots, strict=True))
            infos = await asyncio.gather(
                *(
                    self.scheduler.async_call_engine(
                        w.id,
                        "launch_server",
                        engine_name=self._engine_name(s.index),
                        server_args=s.launch_args(self._hex_server_args),
                    )
                    for w, s in pairs
                )
            )
            await self._hex_initialize(workers, slots)
            return workers, list(infos)

        return run_async_task(start)

    def hex_attach(self, slots, workers, infos) -> None:
        """Add started servers (:meth:`hex_start_servers`) as ranks ``slot.index``: routed with share 0 until the
        elastic watcher re-solves the shares; control calls reach them from now on."""
        with self._hex_lock:
            placement = self.scheduler.placement
            rollout = (*placement.slots[ROLLOUT_ROLE], *slots)
            self.scheduler.placement = replace(placement, slots={**placement.slots, ROLLOUT_ROLE: rollout})
            self.server_infos.extend(infos)
            self._hex_add(slots, workers)

    def hex_start_beside(self, role: str, slots, infos) -> list:
        """Start an eval-rollout worker beside each worker of the scheduler role ``role`` (the training
        controller's :meth:`hex_start_servers` for ``slots``), its engine sending requests to that worker's server
        (``infos``): the workers, not yet routed to (:meth:`hex_attach_beside`)."""
        from areal.api import Job
        from areal.api.cli_args import SchedulingStrategy, SchedulingStrategyType
        from areal.infra.utils.concurrent import run_async_task

        own = f"{self._worker_role}-{role}"
        job = Job(
            replicas=len(slots),
            tasks=[self.config.scheduling_spec[0]] * len(slots),
            scheduling_strategy=SchedulingStrategy(type=SchedulingStrategyType.colocation, target=role),
            role=own,
        )

        async def start():
            workers = await self._hex_workers_with_engines(job, slots)
            await self._hex_initialize(workers, slots, [f"{i.host}:{i.port}" for i in infos])
            return workers

        return run_async_task(start)

    async def _hex_workers_with_engines(self, job, slots) -> list:
        """Create ``job``'s workers (a role this controller deletes at its end) and on each an engine named for
        its slot."""
        self._hex_join_roles = [*getattr(self, "_hex_join_roles", []), job.role]
        self.scheduler.create_workers(job=job)
        workers = self.scheduler.get_workers(role=job.role)
        engine = f"{self.inf_engine.__module__}.{self.inf_engine.__name__}"
        await asyncio.gather(
            *(
                self.scheduler.create_engine(
                    worker_id=w.id, engine=engine, engine_name=self._engine_name(s.index), config=self.config
                )
                for w, s in zip(workers, slots, strict=True)
            )
        )
        return workers

    async def _hex_initialize(self, workers, slots, addrs: Sequence[str] | None = None) -> None:
        """Initialize each worker's engine as rank ``slot.index``; with ``addrs``, each sends to its address."""
        at = [{"addr": a} for a in addrs] if addrs is not None else [{}] * len(slots)
        await asyncio.gather(
            *(
                self.scheduler.async_call_engine(
                    w.id, "initialize", engine_name=self._engine_name(s.index), engine_id=str(s.index), **kw
                )
                for w, s, kw in zip(workers, slots, at, strict=True)
            )
        )

    def hex_attach_beside(self, slots, workers) -> None:
        """Add eval-rollout workers started beside servers that joined (:meth:`hex_start_beside`) as ranks
        ``slot.index``: routed with share 0 until the training shares reach them (:meth:`hex_route_like`)."""
        with self._hex_lock:
            self._hex_add(slots, workers)

    def _hex_add(self, slots, workers) -> None:
        router = self._router()
        for slot in slots:
            self._hex_pools.append(slot.pool)
            router.add_server()
        self.workers.extend(workers)

    def pause(self):
        if self.hex_elastic is not None:  # before a weight update: the route leaves lost servers out
            self.hex_elastic.before_update()
        super().pause()

    def set_version(self, version: int) -> None:
        super().set_version(version)
        if self.hex_elastic is not None:
            self.hex_elastic.on_version(version)

    def destroy(self):
        if self.hex_elastic is not None:
            self.hex_elastic.stop()
        super().destroy()
        for role in getattr(self, "_hex_join_roles", []):  # the workers of machines that joined
            try:
                self.scheduler.delete_workers(role=role)
            except Exception as error:
                logger.error(f"cannot delete the workers of {role}: {error}")

    def _router(self) -> ShareRouter:
        router = getattr(self, "_hex_router", None)
        if router is None:  # once: servers that join are added to it (hex_attach)
            slots = self._slots()[: len(self.workers) or None]
            self._hex_pools = [s.pool for s in slots]
            router = self._hex_router = ShareRouter(
                [s.share for s in slots], self.scheduler.placement.routing
            )
        return router

    def _choose_worker(self):
        """The server for the next request; inside :meth:`_routed` it is released when the call ends, otherwise
        the caller releases it."""
        rank = self._router().choose()
        if self.hex_elastic is not None:
            self.hex_elastic.picked(rank)
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
        upstream = super()._create_submit_callback

        async def attempt(task_input):
            # Upstream returns None for a rollout that failed, timed out or was rejected.
            return await self._routed(upstream(task_input), lambda result: result is not None)

        async def submit_and_release():
            if self.hex_elastic is None:
                return await attempt(pending_task)
            return await self.hex_elastic.submit(
                pending_task, attempt, self._task_id_generator.next, self._forget_task
            )

        return submit_and_release

    def _forget_task(self, task_id: int) -> None:
        with self._futures_lock:
            self._pending_futures.pop(task_id, None)

    async def agenerate(self, req):
        return await self._routed(functools.partial(super().agenerate, req), lambda _: True)

    def export_stats(self) -> dict[str, float]:
        elastic = self.hex_elastic.step_metrics() if self.hex_elastic is not None else {}
        return {**super().export_stats(), **self.pool_sample_stats(), **elastic}

    def pool_sample_stats(self) -> dict[str, float]:
        """Requests each pool completed and failed since the last export, as ``hex/rollout/<pool>/samples`` and
        ``hex/rollout/<pool>/failed``."""
        router = self._router()
        counts: dict[str, float] = defaultdict(float)
        with self._hex_lock:  # a server attached between the two reads is counted from the next export
            taken = (("samples", router.take_completed()), ("failed", router.take_failed()))
            pools = list(self._hex_pools)
        for kind, per_server in taken:
            for pool, n in zip(pools, per_server, strict=True):
                counts[f"hex/rollout/{pool}/{kind}"] += n
        # The eval-rollout controller routes over the same servers; its counts must not replace training's.
        if self._worker_role != "rollout":
            return {}
        return dict(counts)


class HexRemoteSGLangEngine(RelayReceiverMixin, RemoteSGLangEngine):
    """Per-server layouts and flags, share routing, and the relay transport's receiver methods (``hex_*``)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._engine = RemoteInfEngine(config, HexSGLangBackend())
        freeze_heap_at_exit()  # upstream's worker then exits within its grace (fast_exit.py)

    def initialize(self, engine_id=None, addr=None, train_data_parallel_size: int | None = None):
        """Upstream's, except that a rollout worker's executor (started by the controller, which gives no data
        parallel size) gets the whole staleness and in-flight budgets: upstream splits them evenly over the
        servers (``consumer_batch_size // servers``), but share routing sends a server its planned share, and a
        server past 1/n of the batch would wait for a version that needs its own samples (a deadlock). The
        controller's staleness manager, over the whole batch, keeps the bound."""
        return super().initialize(engine_id, addr, train_data_parallel_size or 1)

    def hex_relaunch_server(self, server_args: dict[str, Any]) -> dict[str, Any]:
        """Start this worker's server again (it died, the worker lives) and send requests to it; where it is."""
        from areal.utils.network import format_hostport

        engine = self._engine
        engine.local_server_processes = [
            info
            for info in engine.local_server_processes
            if info.process is None or info.process.poll() is None
        ]
        info = engine.launch_server(dict(server_args))
        self.hex_follow_server(format_hostport(info.host, info.port))
        return {"host": info.host, "port": info.port}

    def hex_follow_server(self, addr: str) -> None:
        """Send requests to ``addr`` from now on: the server was relaunched there (on this worker, or beside this
        eval-rollout worker); requests upstream pinned to the old address (a rid's) follow it too."""
        engine = self._engine
        engine.addresses, engine.server_idx = [addr], 0
        engine.rid_to_address = dict.fromkeys(engine.rid_to_address, addr)

    @classmethod
    def as_controller(cls, config, scheduler):
        if config._version == "v2":
            return super().as_controller(config, scheduler)
        return HexRolloutController(cls, config=config, scheduler=scheduler)
