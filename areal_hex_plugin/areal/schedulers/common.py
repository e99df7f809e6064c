"""What the three Hex schedulers share: per-worker scheduling specs carrying each slot's env, and the rollout engine
their servers run."""

from __future__ import annotations

from dataclasses import replace

from areal.api.cli_args import SchedulingSpec, SchedulingStrategyType
from areal.api.scheduler_api import Job
from areal.infra.scheduler.exceptions import WorkerCreationError

from areal_hex_plugin.areal.worker_slots import Placement, WorkerSlot


class PlannedRollout:
    """The rollout engine class for servers laid out by the plan: with ``patches/0006`` upstream's own trainer asks
    its scheduler for it (``HexPPOTrainer`` chooses it itself)."""

    def rollout_engine_cls(self, backend: str) -> type | None:
        from areal_hex_plugin.areal.plugin import ROLLOUT_ENGINES, load, register

        register()
        path = ROLLOUT_ENGINES.get(backend)
        return load(path) if path else None


def specs_for_slots(
    role: str, tasks: list[SchedulingSpec], slots: tuple[WorkerSlot, ...]
) -> list[SchedulingSpec]:
    """One spec per planned worker: the role's spec with the slot's env (pool, GPU type, GPU ids) added.

    Refuses a job whose replica count or per-worker GPU count differs from the plan, before anything starts.
    """
    if not tasks:
        raise WorkerCreationError(role, "No scheduling spec", "give the role a scheduling_spec")
    if len(tasks) not in (1, len(slots)):
        raise WorkerCreationError(
            role, "Plan mismatch", f"{len(tasks)} specs for {len(slots)} planned workers"
        )
    specs = tasks * len(slots) if len(tasks) == 1 else list(tasks)
    out = []
    for spec, slot in zip(specs, slots, strict=True):
        if spec.gpu != len(slot.gpu_ids):
            raise WorkerCreationError(
                role,
                "Plan mismatch",
                f"worker {slot.index} asks for {spec.gpu} GPUs but the plan gives it {len(slot.gpu_ids)}",
            )
        out.append(replace(spec, env_vars={**spec.env_vars, **slot.env()}))
    return out


def announced_session(exp_config, who: str):
    """The run's session for a scheduler upstream builds from ``exp_config`` alone (:func:`session_for`), its
    config checked as the pre-flight checks it (where no pre-flight ran) and what it decided printed once."""
    from areal_hex_plugin.areal.preflight import check_config
    from areal_hex_plugin.areal.session import session_for
    from areal_hex_plugin.areal.startup import announce

    session = session_for(exp_config, who)
    if not session.passed:  # opened here, for upstream's own script: no pre-flight checked its config
        session.passed += [f"scheduler: {who}, built by upstream from exp_config", *check_config(exp_config)]
    announce(session)
    return session


def check_replicas(role: str, replicas: int, slots: tuple[WorkerSlot, ...]) -> None:
    if replicas != len(slots):
        raise WorkerCreationError(
            role, "Plan mismatch", f"upstream asks for {replicas} workers but the plan places {len(slots)}"
        )


def planned_job(placement: Placement, job: Job) -> tuple[Job, tuple[WorkerSlot, ...] | None]:
    """``job`` with one spec per planned worker, and its slots; unplanned or colocated roles pass unchanged."""
    slots = placement.for_role(job.role)
    separate = SchedulingStrategyType(job.scheduling_strategy.type) == SchedulingStrategyType.separation
    if slots is None or not separate:
        return job, None
    check_replicas(job.role, job.replicas, slots)
    return replace(job, tasks=specs_for_slots(job.role, list(job.tasks), slots)), slots
