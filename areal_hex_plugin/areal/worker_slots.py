"""From a HexPlan to upstream's world: one worker slot per upstream worker, and the checks that come first.

Upstream starts ``actor`` workers one GPU each (rank order) and ``rollout`` workers one server each (``tp*pp``
GPUs). A :class:`Placement` says, for every such worker, which pool, GPU type, host and GPU ids it gets; the
Hex schedulers (local, Ray, Slurm) only carry it out. Pure data: no upstream import.

Every rollout server keeps its replica group's own TP/PP and planned concurrency (``HexRolloutController`` gives
each worker its own GPU count and ``server_args``); each server runs on ``tp*pp`` GPUs of one machine.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from areal_hex_plugin.errors import HexError, UpstreamLimit
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.planner.caps import RuntimeCaps, unmet

TRAIN_ROLE = "actor"
# hex_local only: "1" lets planned roles share this machine's GPUs (smoke tests on a one-GPU machine).
SHARE_GPUS_ENV = "HEX_LOCAL_SHARE_GPUS"
# Actor workers of a pipelined plan: each stage's planned layer count, space-separated (HexMegatronPPOActor).
PP_LAYERS_ENV = "HEX_PP_LAYERS"
ROLLOUT_ROLE = "rollout"


@dataclass(frozen=True)
class WorkerSlot:
    """Where one upstream worker runs: ``role``/``index`` on ``host`` of ``pool``, with these GPU ids."""

    role: str
    index: int
    pool: str
    gpu_type: str
    host: str
    gpu_ids: tuple[int, ...]
    share: float = 0.0  # rollout: this server's fraction of a step's samples
    tp: int = 1  # rollout: the server's tensor- and pipeline-parallel sizes (its replica group's)
    pp: int = 1
    # rollout: the requests the plan keeps in flight on this server (max_running_requests)
    concurrency: int = 0
    # rollout: what this server changes in upstream's server_args
    server_flags: tuple[tuple[str, Any], ...] = ()
    stage: int = 0  # actor: the pipeline stage this rank serves
    pp_layers: tuple[int, ...] = ()  # actor, pipelined: every stage's planned layer count (Megatron's layout)

    def launch_args(self, server_args: dict[str, Any]) -> dict[str, Any]:
        """Upstream's ``server_args`` with this server's own flags (``pp_size`` only above 1, as upstream)."""
        args = {**server_args, **dict(self.server_flags)}
        if args.get("pp_size") == 1:
            del args["pp_size"]
        return args

    def env(self) -> dict[str, str]:
        """Env vars a worker gets so it (and its logs) know its pool, GPU type, host and GPU ids."""
        return {
            "HEX_ROLE": self.role,
            "HEX_POOL": self.pool,
            "HEX_GPU_TYPE": self.gpu_type,
            "HEX_HOST": self.host,
            # Space-separated: upstream's local scheduler splits its env string on commas.
            "HEX_GPU_IDS": " ".join(map(str, self.gpu_ids)),
            **({PP_LAYERS_ENV: " ".join(map(str, self.pp_layers))} if self.pp_layers else {}),
        }


@dataclass(frozen=True)
class Placement:
    """Per-role worker slots plus the parallel layout upstream's backend strings must carry."""

    slots: dict[str, tuple[WorkerSlot, ...]]
    train_dp: int
    train_tp: int
    train_pp: int
    routing: str = "shares"  # hex.routing: how the rollout controller spreads requests over the servers

    def for_role(self, role: str) -> tuple[WorkerSlot, ...] | None:
        return self.slots.get(role)

    @property
    def rollout_layouts(self) -> list[tuple[int, int]]:
        """The distinct (tp, pp) of the rollout servers, sorted."""
        return sorted({(s.tp, s.pp) for s in self.slots.get(ROLLOUT_ROLE, ())})


def check_plan_runs(plan: HexPlan, caps: RuntimeCaps) -> None:
    """Refuse a plan the runtime of ``caps`` cannot start (e.g. one made with ``areal-hex plan --unconstrained``
    or for other backends), naming every unmet capability."""
    problems = unmet(plan, caps)
    if problems:
        raise UpstreamLimit(
            "plan",
            f"{caps.describe()} cannot run this plan: "
            + "; ".join(f"{what}: {why}" for what, why in problems.items()),
            "plan for the recipe's backends (areal-hex plan RECIPE --json PLAN, without --unconstrained), or "
            "change actor.backend / hex.transport to a runtime that has these capabilities",
        )


def placement_from_plan(plan: HexPlan) -> Placement:
    """Worker slots for ``actor`` (one GPU each, in upstream's rank order) and ``rollout`` (one server each)."""
    stages = plan.train.stages
    if not stages:
        raise HexError("plan.train.stages", "is empty", "re-create the plan; training needs GPUs")
    dp, tp = stages[0].dp, stages[0].tp
    if any((s.dp, s.tp) != (dp, tp) for s in stages):
        raise HexError(
            "plan.train.stages",
            "stages differ in dp or tp; upstream's actor backend has one dp and one tp for all stages",
            "re-plan with hex.solver.max_pp_stages=1, or with a cluster where training uses one GPU type",
        )
    groups = plan.rollout.replicas
    if not groups:
        raise HexError("plan.rollout.replicas", "is empty", "re-create the plan; rollout needs GPUs")

    train: dict[tuple[int, int, int], tuple[str, str, str, int]] = {}
    rollout: dict[tuple[int, int], list[tuple[int, int, str, str, str, int]]] = defaultdict(list)
    for m_index, machine in enumerate(plan.machines):
        for gpu in machine.gpus:
            where = f"plan.machines[{m_index}] ({machine.host}) gpu {gpu.gpu}"
            if gpu.role == "train":
                key = (gpu.stage or 0, gpu.dp_rank or 0, gpu.tp_rank or 0)
                if key in train:
                    raise HexError(where, f"repeats train rank (stage, dp, tp) = {key}", "re-create the plan")
                train[key] = (machine.pool, machine.gpu_type, machine.host, gpu.gpu)
            elif gpu.role == "rollout":
                rollout[(gpu.group or 0, gpu.instance or 0)].append(
                    (gpu.stage or 0, gpu.tp_rank or 0, machine.pool, machine.gpu_type, machine.host, gpu.gpu)
                )
    expected = len(stages) * dp * tp
    if len(train) != expected:
        raise HexError(
            "plan.machines",
            f"assign {len(train)} GPUs to training but the train stages need {expected}",
            "re-create the plan",
        )
    # Ranks stage-major, then dp, then tp: Megatron's order "tp-cp-ep-dp-pp" puts rank r in stage r // (dp*tp).
    layers = tuple(s.layers for s in stages) if len(stages) > 1 else ()
    train_slots = tuple(
        WorkerSlot(TRAIN_ROLE, rank, pool, gpu_type, host, (gpu,), stage=key[0], pp_layers=layers)
        for rank, (key, (pool, gpu_type, host, gpu)) in enumerate(sorted(train.items()))
    )
    rollout_slots = []
    for (group, instance), gpus in sorted(rollout.items()):
        if group >= len(groups):
            raise HexError(
                "plan.machines", f"name rollout group {group} that does not exist", "re-create the plan"
            )
        hosts = {g[4] for g in gpus}
        spec = groups[group]
        if len(hosts) != 1 or len(gpus) != spec.tp * spec.pp:
            raise HexError(
                "plan.machines",
                f"rollout group {group} instance {instance} has {len(gpus)} GPUs on {sorted(hosts)}; upstream "
                f"runs each server on its tp*pp = {spec.tp * spec.pp} GPUs of one machine",
                "re-plan for upstream's runtime (areal-hex plan without --unconstrained)",
            )
        _, _, pool, gpu_type, host, _ = gpus[0]
        share = spec.share / max(spec.count, 1)
        ids = tuple(g[5] for g in sorted(gpus))
        rollout_slots.append(
            WorkerSlot(
                ROLLOUT_ROLE,
                len(rollout_slots),
                pool,
                gpu_type,
                host,
                ids,
                share,
                tp=spec.tp,
                pp=spec.pp,
                concurrency=spec.concurrency,
            )
        )
    planned = sum(g.count for g in groups)
    if len(rollout_slots) != planned:
        raise HexError(
            "plan.machines",
            f"place {len(rollout_slots)} rollout servers but the replica groups count {planned}",
            "re-create the plan",
        )
    return Placement(
        slots={TRAIN_ROLE: train_slots, ROLLOUT_ROLE: tuple(rollout_slots)},
        train_dp=dp,
        train_tp=tp,
        train_pp=len(stages),
    )


def check_plan_fits_inventory(plan: HexPlan, pools: list, source: str) -> None:
    """Refuse a plan the live cluster cannot host: a GPU type gone, or fewer machines of it than planned.

    ``pools`` are :class:`areal_hex_plugin.inventory.DiscoveredPool` records read from the running cluster.
    Planned host names are checked when the plan names real hosts; otherwise machine counts per type are.
    """
    live: dict[str, set[str]] = defaultdict(set)
    for pool in pools:
        live[pool.gpu_type].update(pool.hosts)
    planned: dict[str, set[str]] = defaultdict(set)
    for machine in plan.machines:
        if machine.role != "idle":
            planned[machine.gpu_type].add(machine.host)
    for gpu_type, hosts in sorted(planned.items()):
        have = live.get(gpu_type, set())
        if not have:
            raise HexError(
                "hex.plan_path",
                f"the plan needs {gpu_type} machines but the live {source} cluster has none "
                f"(it has {', '.join(sorted(live)) or 'no GPUs'})",
                "start the missing machines, or re-plan for the live inventory (areal-hex inventory --from "
                f"{source})",
            )
        named = hosts & have
        if (named and named != hosts) or len(hosts) > len(have):
            raise HexError(
                "hex.plan_path",
                f"the plan uses {len(hosts)} {gpu_type} machines but the live {source} cluster has "
                f"{len(have)}" + (f"; missing: {', '.join(sorted(hosts - have))}" if named else ""),
                "start the missing machines, or re-plan for the live inventory",
            )


def node_local(placement: Placement, plan: HexPlan, devices: list[int] | None = None) -> Placement:
    """The placement with every planned machine laid side by side on one node (GPU ids offset per machine).

    With ``devices``, planned GPU k runs on ``devices[k % len(devices)]``: roles then share GPUs (a one-GPU
    smoke test; weight updates must go through disk, NCCL refuses two ranks on one GPU).
    """
    offsets: dict[str, int] = {}
    next_id = 0
    for machine in plan.machines:
        offsets[machine.host] = next_id
        next_id += max((g.gpu for g in machine.gpus), default=-1) + 1

    def device(host: str, gpu: int) -> int:
        k = offsets[host] + gpu
        return devices[k % len(devices)] if devices else k

    slots = {
        role: tuple(replace(s, gpu_ids=tuple(device(s.host, i) for i in s.gpu_ids)) for s in role_slots)
        for role, role_slots in placement.slots.items()
    }
    return replace(placement, slots=slots)


def check_local_gpus(plan: HexPlan, machines: list, share: bool = False) -> list[int]:
    """hex_local lays every planned machine on this node: it needs the planned GPU types, and as many GPUs of
    each as planned unless ``share``. Returns this node's device ids."""
    from areal_hex_plugin.inventory import canonical_gpu_type
    from areal_hex_plugin.specs.catalog import build_catalog

    catalog = build_catalog()
    have: dict[str, int] = defaultdict(int)
    for m in machines:
        have[canonical_gpu_type(m.gpu_name, catalog)] += m.gpus
    need: dict[str, int] = defaultdict(int)
    for machine in plan.machines:
        need[machine.gpu_type] += sum(1 for g in machine.gpus if g.role != "idle")
    for gpu_type, n in sorted(need.items()):
        if n and have.get(gpu_type, 0) < (1 if share else n):
            raise HexError(
                "hex.plan_path",
                f"the plan needs {n} {gpu_type} GPUs but this machine has {have.get(gpu_type, 0)}",
                "re-plan for this machine (areal-hex inventory --from local) or use hex_ray/hex_slurm",
            )
    return list(range(sum(have.values())))
