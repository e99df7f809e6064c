"""``HexLocalScheduler``: upstream's LocalScheduler with a GPU-id pool per role instead of one shared counter."""

from __future__ import annotations

import os
from collections import deque

from areal.api.scheduler_api import Job
from areal.infra.scheduler.exceptions import GPUAllocationError
from areal.infra.scheduler.local import LocalScheduler

from areal_hex_plugin.areal.schedulers.common import PlannedRollout, announced_session, planned_job
from areal_hex_plugin.areal.session import HexSession
from areal_hex_plugin.areal.worker_slots import SHARE_GPUS_ENV, Placement, check_local_gpus, node_local


class HexLocalScheduler(PlannedRollout, LocalScheduler):
    """Starts each planned worker on exactly the GPU ids its slot names (one node; see ``placement.node_local``).

    Roles the plan does not place (``data``, colocated ``ref``/``eval-rollout``) keep upstream's behaviour.
    ``HexLocalScheduler(exp_config=config)`` takes the run's session for ``config`` (:func:`session_for`).
    """

    hex_joins_machines = True  # areal-hex join starts a machine's servers through it (areal/join.py)

    def __init__(self, placement: Placement | None = None, **kwargs) -> None:
        if placement is None:  # built from exp_config alone (upstream's way): set up here
            placement = self.setup(announced_session(kwargs.get("exp_config"), "hex_local"))["placement"]
        ids = sorted({i for slots in placement.slots.values() for s in slots for i in s.gpu_ids})
        super().__init__(gpu_devices=kwargs.pop("gpu_devices", None) or ids, **kwargs)
        self.placement = placement
        self._planned_ids: deque[tuple[int, ...]] | None = None

    @staticmethod
    def setup(session: HexSession) -> dict:
        """The plan's placement on this node's GPUs, checked against them (``HEX_LOCAL_SHARE_GPUS=1``: planned
        roles may share them)."""
        share = os.environ.get(SHARE_GPUS_ENV) == "1"
        devices = check_local_gpus(session.plan, list(session.live_inventory("local").machines), share)
        return {"placement": node_local(session.placement, session.plan, devices if share else None)}

    def create_workers(self, job: Job, *args, **kwargs) -> list[str]:
        job, slots = planned_job(self.placement, job)
        if slots is None:
            return super().create_workers(job, *args, **kwargs)
        self._planned_ids = deque(s.gpu_ids for s in slots)
        try:
            return super().create_workers(job, *args, **kwargs)
        finally:
            self._planned_ids = None

    def _find_worker_by_id(self, worker_id: str):
        # Over a copy: a join or a live re-layout adds a role from its own thread while RPCs look workers up.
        for workers in list(self._workers.values()):
            for info in workers:
                if info.worker.id == worker_id:
                    return info
        return None

    def _allocate_gpus(self, num_gpus: int) -> list[int]:
        if self._planned_ids is None:
            return super()._allocate_gpus(num_gpus)
        ids = self._planned_ids.popleft()
        if len(ids) != num_gpus:
            raise GPUAllocationError(
                f"the plan gives this worker {len(ids)} GPUs, upstream asks for {num_gpus}"
            )
        return list(ids)
