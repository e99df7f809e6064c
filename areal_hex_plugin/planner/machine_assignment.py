"""Turn a scored split into concrete placement: which host and GPU serves which train stage or rollout replica.

Machines of a pool are taken in inventory order: the first ones train, the next one is split between the roles
where the split shares one (its first GPUs train, the others serve its colocated replicas), the next ones
generate, the rest idle.
Train stages fill their pool's training GPUs contiguously (TP ranks fastest), so a TP group never crosses a
machine. Rollout replicas whose sizes (tp*pp) all lie on the machine size's divisibility chain are packed whole,
largest first, so each sits in one machine (one upstream server); otherwise their stages are packed largest TP
first. Either way the packing is exact and no TP group crosses a machine.
"""

from __future__ import annotations

from areal_hex_plugin.plan import GpuAssignment, Machine, ReplicaGroup, RolloutPlan, TrainPlan, TrainStage
from areal_hex_plugin.planner.evaluate import Evaluation
from areal_hex_plugin.planner.rollout_model import largest_remainder
from areal_hex_plugin.planner.train_search import tp_degrees
from areal_hex_plugin.specs.cluster import Cluster


def place(cluster: Cluster, e: Evaluation) -> tuple[TrainPlan, RolloutPlan, list[Machine]]:
    slots: dict[tuple[str, int], list[GpuAssignment]] = {}
    train_hosts: dict[str, list[str]] = {}
    rollout_hosts: dict[str, list[str]] = {}
    split_hosts: dict[str, tuple[str, int]] = {}  # pool -> its split machine and the GPUs that train there
    for i, (pool, t, r) in enumerate(zip(cluster.pools, e.split.train, e.split.rollout, strict=True)):
        g = e.split.shared_gpus(i)
        train_hosts[pool.name] = [pool.host(k) for k in range(t + (1 if g else 0))]
        if g:
            split_hosts[pool.name] = (pool.host(t), g)
        rollout_hosts[pool.name] = [pool.host(k) for k in range(t + (1 if g else 0), t + (1 if g else 0) + r)]
    train = _place_train(cluster, e, train_hosts, slots)
    rollout = _place_rollout(cluster, e, rollout_hosts, split_hosts, slots)
    machines = []
    for pool in cluster.pools:
        for i in range(pool.machines):
            host = pool.host(i)
            gpus = [
                slots.get((host, g)) or GpuAssignment(gpu=g, role="idle")
                for g in range(pool.gpus_per_machine)
            ]
            roles = {a.role for a in gpus} - {"idle"}
            role = "split" if len(roles) > 1 else roles.pop() if roles else "idle"
            machines.append(Machine(pool.name, host, pool.gpu_type, role, gpus))
    return train, rollout, machines


def _place_train(cluster: Cluster, e: Evaluation, hosts: dict[str, list[str]], slots) -> TrainPlan:
    if e.train is None:
        return TrainPlan(gpus={}, stages=[])
    layers = e.train.estimate.layers
    next_gpu: dict[str, int] = {}
    stages: list[TrainStage] = []
    gpus_by_type: dict[str, int] = {}
    for k, stage in enumerate(e.train.stages):
        pool = cluster.pool(stage.pool)
        start = next_gpu.get(pool.name, 0)
        used_hosts: list[str] = []
        for offset in range(stage.dp * stage.tp):
            index = start + offset
            host = hosts[pool.name][index // pool.gpus_per_machine]
            gpu = index % pool.gpus_per_machine
            slots[(host, gpu)] = GpuAssignment(
                gpu=gpu, role="train", stage=k, dp_rank=offset // stage.tp, tp_rank=offset % stage.tp
            )
            if host not in used_hosts:
                used_hosts.append(host)
        next_gpu[pool.name] = start + stage.dp * stage.tp
        gpus_by_type[pool.gpu_type] = gpus_by_type.get(pool.gpu_type, 0) + stage.dp * stage.tp
        stages.append(
            TrainStage(pool.name, pool.gpu_type, stage.dp, stage.tp, layers[k], used_hosts, stage.hybrid)
        )
    memory = max(e.train.estimate.memory_gb_per_gpu, default=0.0)
    return TrainPlan(gpus=gpus_by_type, stages=stages, memory_gb_per_gpu=round(memory, 3))


def _place_rollout(
    cluster: Cluster,
    e: Evaluation,
    hosts: dict[str, list[str]],
    split_hosts: dict[str, tuple[str, int]],
    slots,
) -> RolloutPlan:
    samples = sum(e.shares)  # over one window
    per_step = largest_remainder(samples // e.window, list(e.shares))
    groups: list[ReplicaGroup] = []
    gpus_by_type: dict[str, int] = {}
    # Stage slots to pack per pool: (tp, group, instance, stage), largest TP first.
    pending: dict[str, list[tuple[int, int, int, int]]] = {}
    for g, ((config, count), share, step) in enumerate(zip(e.fleet.groups, e.shares, per_step, strict=True)):
        pool = cluster.pool(config.pool)
        groups.append(
            ReplicaGroup(
                pool=pool.name,
                gpu_type=pool.gpu_type,
                tp=config.tp,
                pp=config.pp,
                count=count,
                share=round(share / samples, 6) if samples else 0.0,
                samples_per_step=step,
                tokens_per_s=round(config.tokens_per_s, 3),
                concurrency=config.concurrency,
            )
        )
        gpus_by_type[pool.gpu_type] = gpus_by_type.get(pool.gpu_type, 0) + config.gpus * count
        # Colocated replicas go to the pool's split machine, after its training GPUs.
        key = (pool.name, config.colocated)
        pending.setdefault(key, []).extend(
            (config.tp, g, i, s) for i in range(count) for s in range(config.pp)
        )
    for (pool_name, colocated), stage_slots in pending.items():
        pool = cluster.pool(pool_name)
        if colocated:
            host, first = split_hosts[pool_name]
            machines = [host]
        else:
            machines, first = hosts[pool_name], 0
        cursor = first  # GPUs handed out so far in this pool's rollout machines
        sizes = {g: groups[g].tp * groups[g].pp for _, g, _, _ in stage_slots}
        if set(sizes.values()) <= set(tp_degrees(pool.gpus_per_machine)):
            order = sorted(stage_slots, key=lambda x: (-sizes[x[1]], x[1], x[2], x[3]))
        else:
            order = sorted(stage_slots, key=lambda x: (-x[0], x[1], x[2], x[3]))
        for tp, g, i, s in order:
            for rank in range(tp):
                host = machines[(cursor + rank) // pool.gpus_per_machine]
                gpu = (cursor + rank) % pool.gpus_per_machine
                slots[(host, gpu)] = GpuAssignment(
                    gpu=gpu, role="rollout", stage=s, tp_rank=rank, group=g, instance=i
                )
            cursor += tp
    return RolloutPlan(gpus=gpus_by_type, replicas=groups)
