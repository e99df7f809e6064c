"""``HexSlurmScheduler``: upstream's SlurmScheduler with one heterogeneous-job component per pool and host group.

Upstream submits one sbatch per role asking every node for ``--gres=gpu:<n_gpus_per_node>`` of any type. Here
a planned role's job has one component per run of consecutive hosts of one pool with the same number of
workers: each component names its hosts (``--nodelist``), typed GRES (``--gres=gpu:<type>:<n>``), partition and
constraint. ``srun`` launches all components in one step, so ``SLURM_PROCID`` (upstream's worker index) runs
across them in plan order. Each worker's env (pool, GPU type, the user's ``env_vars``) is exported in native
mode too, where upstream drops it, and each spec's ``container_type``/``mount`` are honoured.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from itertools import groupby

from areal.api.cli_args import SchedulingSpec
from areal.api.scheduler_api import Job
from areal.infra.scheduler.slurm import SlurmScheduler
from areal.infra.utils.proc import build_streaming_log_cmd

from areal_hex_plugin.areal.schedulers.common import PlannedRollout, announced_session, planned_job
from areal_hex_plugin.areal.session import HexSession
from areal_hex_plugin.areal.worker_slots import Placement, WorkerSlot, check_plan_fits_inventory
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.inventory import Machine, canonical_gpu_type, group_pools
from areal_hex_plugin.specs.catalog import build_catalog


@dataclass(frozen=True)
class SlurmPool:
    """How Slurm names a pool's machines: GRES type (None: untyped GRES), partition, constraint, node size."""

    gpus_per_node: int
    gres_type: str | None = None
    partition: str | None = None
    constraint: str | None = None


@dataclass(frozen=True)
class _Component:
    pool: str
    hosts: tuple[str, ...]
    tasks_per_node: int
    gpus_per_task: int
    first: int  # index of the component's first worker


def slurm_pools_from_sinfo(
    placement: Placement, machines: list[Machine], gpus_per_node: dict[str, int]
) -> dict:
    """Pool -> :class:`SlurmPool`, reading GRES types and partitions off the live ``sinfo`` machines."""
    catalog = build_catalog()
    out = {}
    for slots in placement.slots.values():
        for slot in slots:
            if slot.pool in out:
                continue
            live = [m for m in machines if canonical_gpu_type(m.gpu_name, catalog) == slot.gpu_type]
            if not live:
                raise HexError(
                    "hex.plan_path",
                    f"the plan needs {slot.gpu_type} nodes but sinfo lists none",
                    "re-plan for the live inventory (areal-hex inventory --from slurm)",
                )
            hosts = {s.host for s in slots if s.pool == slot.pool}
            mine = [m for m in live if m.host in hosts] or live
            common = set.intersection(*(set(m.partitions) for m in mine)) if mine else set()
            out[slot.pool] = SlurmPool(
                gpus_per_node=gpus_per_node.get(slot.pool, mine[0].gpus),
                gres_type=mine[0].gpu_name if mine[0].typed_gres else None,
                partition=min(common) if common else None,
                constraint=None if mine[0].typed_gres else mine[0].gpu_name,
            )
    return out


def check_slurm_placement(placement: Placement) -> None:
    """Every role's workers as Slurm heterogeneous-job components, or the HexError that says why not (before any
    sbatch): a node's tasks share one GPU count, so one machine cannot host servers of different layouts."""
    for slots in placement.slots.values():
        _components(slots)


def _components(slots: tuple[WorkerSlot, ...]) -> list[_Component]:
    """Runs of consecutive hosts of one pool holding the same number of workers, in worker order."""
    runs = []  # (pool, host, n_workers, gpus_per_worker, first index)
    for host, group in groupby(slots, key=lambda s: s.host):
        members = list(group)
        if any(r[1] == host for r in runs):
            raise HexError("plan.machines", f"host {host} serves workers that are not consecutive", "re-plan")
        ids = [i for s in members for i in s.gpu_ids]
        gpus = len(members[0].gpu_ids)
        if any(len(s.gpu_ids) != gpus for s in members):
            raise HexError(
                "plan.machines",
                f"host {host} runs workers of {sorted({len(s.gpu_ids) for s in members})} GPUs; a Slurm node's "
                "tasks share one GPU count",
                "use hex_ray or hex_local, or re-plan one rollout layout for every server with "
                "+hex.solver.rollout_layout=[TP,PP]",
            )
        if ids != list(range(len(ids))):
            raise HexError(
                "plan.machines",
                f"host {host} uses GPUs {ids}; Slurm gives task k of a node GPUs k*g .. k*g+g-1",
                "re-plan so each machine's workers use its first GPUs in order",
            )
        runs.append((members[0].pool, host, len(members), gpus, members[0].index))
    components: list[_Component] = []
    for run in runs:
        last = components[-1] if components else None
        if last and (last.pool, last.tasks_per_node, last.gpus_per_task) == (run[0], run[2], run[3]):
            components[-1] = replace(last, hosts=last.hosts + (run[1],))
        else:
            components.append(_Component(run[0], (run[1],), run[2], run[3], run[4]))
    return components


class HexSlurmScheduler(PlannedRollout, SlurmScheduler):
    """Submits each planned role as a heterogeneous job whose components sit on the planned pools and hosts.
    ``HexSlurmScheduler(exp_config=config)`` takes the run's session for ``config`` (:func:`session_for`)."""

    def __init__(
        self, placement: Placement | None = None, pools: dict[str, SlurmPool] | None = None, **kwargs
    ) -> None:
        if placement is None:  # built from exp_config alone (upstream's way): set up here
            planned = self.setup(announced_session(kwargs.get("exp_config"), "hex_slurm"))
            placement, pools = planned["placement"], planned["pools"]
        super().__init__(**kwargs)
        self.placement = placement
        self.pools = pools or {}

    @staticmethod
    def setup(session: HexSession) -> dict:
        """The plan's placement as heterogeneous-job components and each pool's GRES, partition and constraint,
        checked against the live ``sinfo``."""
        check_slurm_placement(session.placement)
        machines = list(session.live_inventory("slurm").machines)
        check_plan_fits_inventory(session.plan, group_pools(machines), "slurm")
        gpus_per_node = {p.name: p.gpus_per_machine for p in session.config.hex.cluster.pools}
        return {
            "placement": session.placement,
            "pools": slurm_pools_from_sinfo(session.placement, machines, gpus_per_node),
        }

    def create_workers(self, job: Job, *args, **kwargs) -> list[str]:
        return super().create_workers(planned_job(self.placement, job)[0], *args, **kwargs)

    def _generate_sbatch_script(self, role: str, replicas: int, nodes: int, total_gpus: int, **kwargs) -> str:
        slots = self.placement.for_role(role)
        schedulings: list[SchedulingSpec] = kwargs["schedulings"]
        if slots is None or "HEX_POOL" not in schedulings[0].env_vars:
            return super()._generate_sbatch_script(role, replicas, nodes, total_gpus, **kwargs)
        cpus, mem = kwargs["cpus_per_task"], kwargs["mem_per_task"]
        directives, steps = [], []
        for k, comp in enumerate(_components(slots)):
            pool = self.pools[comp.pool]
            spec = schedulings[comp.first]
            gpus_on_node = comp.tasks_per_node * comp.gpus_per_task
            if gpus_on_node > pool.gpus_per_node:
                raise HexError(
                    "plan",
                    f"pool {comp.pool} puts {gpus_on_node} GPUs on a {pool.gpus_per_node}-GPU node",
                    "re-plan",
                )
            gres = f"gpu:{pool.gres_type}:{gpus_on_node}" if pool.gres_type else f"gpu:{gpus_on_node}"
            options = [f"--job-name={self._slurm_name(role)}", "--output=/dev/null", "--no-requeue"] * (
                k == 0
            )
            options += [f"--partition={pool.partition}"] if pool.partition else []
            options += [f"--constraint={pool.constraint}"] if pool.constraint else []
            options += [
                f"--nodes={len(comp.hosts)}",
                f"--ntasks-per-node={comp.tasks_per_node}",
                f"--cpus-per-task={cpus}",
                f"--mem={mem * comp.tasks_per_node}M",
            ]
            options += [f"--gres={gres}"] if gpus_on_node else []
            options += [f"--nodelist={','.join(comp.hosts)}"]
            if k > 0:
                directives.append("#SBATCH hetjob")
            directives += [f"#SBATCH {o}" for o in options]
            flags = [
                f"--het-group={k}",
                f"--nodes={len(comp.hosts)}",
                f"--ntasks={len(comp.hosts) * comp.tasks_per_node}",
                f"--cpus-per-task={cpus}",
                f"--mem-per-cpu={mem // cpus if cpus else mem}M",
            ]
            flags += [f"--gres={gres}"] if gpus_on_node else []
            steps.append(f"{' '.join(flags)} {self._task_command(role, spec)}")
        srun = f"srun {self.srun_additional_args} " + " : ".join(steps)
        log = build_streaming_log_cmd(srun, self._log_path_of(role), self._merged_log_path(), role)
        return "#!/bin/bash\n" + "\n".join(directives) + f"\n\n# One srun step over all components.\n{log}\n"

    def _task_command(self, role: str, spec: SchedulingSpec) -> str:
        """One component's task: pin GPUs by local id, export the worker env, start the RPC server."""
        g = spec.gpu
        # A component shares one spec, so per-task values come from Slurm at run time.
        per_task = {"HEX_HOST", "HEX_GPU_IDS"}
        cmds = [
            f"export {k}={shlex.quote(str(v))}" for k, v in sorted(spec.env_vars.items()) if k not in per_task
        ]
        cmds.append("export HEX_HOST=$(hostname -s)")
        if g > 0:
            first = f"$((SLURM_LOCALID * {g}))"
            cmds.insert(
                0, f"export CUDA_VISIBLE_DEVICES=$(seq -s, {first} $((SLURM_LOCALID * {g} + {g - 1})))"
            )
            cmds.append('export HEX_GPU_IDS="${CUDA_VISIBLE_DEVICES//,/ }"')
        cmds += [*(spec.additional_bash_cmds or []), self._rpc_command(role, spec)]
        inner = "bash -c " + shlex.quote(";\n".join(cmds))
        # The spec's own container settings (upstream's Slurm scheduler reads only its constructor's).
        if spec.container_type != "apptainer":
            return inner
        mounts = f" --bind {spec.mount}" if spec.mount else ""
        return f"singularity exec --no-home --writable-tmpfs --nv{mounts} {spec.image} {inner}"

    def _rpc_command(self, role: str, spec: SchedulingSpec) -> str:
        flags = [
            "--experiment-name", self.experiment_name, "--trial-name", self.trial_name, "--role", role,
            "--name-resolve-type", self.name_resolve_config.type,
            "--nfs-record-root", self.name_resolve_config.nfs_record_root,
            "--etcd3-addr", self.name_resolve_config.etcd3_addr,
        ]  # fmt: skip
        if self.fileroot:
            flags += ["--fileroot", str(self.fileroot)]
        return " ".join([spec.cmd or "python -m areal.infra.rpc.rpc_server", *flags])
