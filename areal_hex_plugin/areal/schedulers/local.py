"""``HexLocalScheduler``: upstream's LocalScheduler with a GPU-id pool per role instead of one shared counter."""

from __future__ import annotations

from collections import deque

from areal.api.scheduler_api import Job
from areal.infra.scheduler.exceptions import GPUAllocationError
from areal.infra.scheduler.local import LocalScheduler

from areal_hex_plugin.areal.launch import from_exp_config
from areal_hex_plugin.areal.placement import Placement
from areal_hex_plugin.areal.schedulers.common import planned_job


class HexLocalScheduler(LocalScheduler):
    """Starts each planned worker on exactly the GPU ids its slot names (one node; see ``placement.node_local``).

    Roles the plan does not place (``data``, colocated ``ref``/``eval-rollout``) keep upstream's behaviour.
    ``HexLocalScheduler(exp_config=config)`` plans from ``config.hex`` and rewrites ``config`` to the plan.
    """

    def __init__(self, placement: Placement | None = None, **kwargs) -> None:
        if placement is None:  # built from exp_config alone (upstream's way): plan and check here
            placement = from_exp_config("hex_local", kwargs.get("exp_config"))["placement"]
        ids = sorted({i for slots in placement.slots.values() for s in slots for i in s.gpu_ids})
        super().__init__(gpu_devices=kwargs.pop("gpu_devices", None) or ids, **kwargs)
        self.placement = placement
        self._planned_ids: deque[tuple[int, ...]] | None = None

    def create_workers(self, job: Job, *args, **kwargs) -> list[str]:
        job, slots = planned_job(self.placement, job)
        if slots is None:
            return super().create_workers(job, *args, **kwargs)
        self._planned_ids = deque(s.gpu_ids for s in slots)
        try:
            return super().create_workers(job, *args, **kwargs)
        finally:
            self._planned_ids = None

    def _allocate_gpus(self, num_gpus: int) -> list[int]:
        if self._planned_ids is None:
            return super()._allocate_gpus(num_gpus)
        ids = self._planned_ids.popleft()
        if len(ids) != num_gpus:
            raise GPUAllocationError(
                f"the plan gives this worker {len(ids)} GPUs, upstream asks for {num_gpus}"
            )
        return list(ids)
