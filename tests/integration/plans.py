"""A small two-GPU-type HexPlan written by hand, for placement and scheduler tests.

Pools: ``big`` (H100, machines big-0 and big-1, 2 GPUs each) and ``small`` (L40S, small-0 and small-1, 2 GPUs
each). big-0 trains (fsdp d2); big-1 runs 2 rollout servers (group 0, share 0.5); the L40S machines run 4 rollout
servers (group 1, share 0.5).
"""

from __future__ import annotations

from areal_hex_plugin.plan import (
    GpuAssignment,
    HexPlan,
    Machine,
    Objective,
    Predicted,
    ReplicaGroup,
    RolloutPlan,
    SolverInfo,
    Staleness,
    TrainPlan,
    TrainStage,
)


def two_type_plan(servers_per_machine: int = 2, big_tp: int = 1) -> HexPlan:
    """The plan above; ``servers_per_machine=1`` leaves each rollout machine's second GPU idle (fewer workers);
    ``big_tp=2`` makes big-1 one tp2 server (two replica groups with different layouts)."""
    n = servers_per_machine

    def rollout_machine(pool: str, host: str, gpu_type: str, group: int, first: int) -> Machine:
        if group == 0 and big_tp == 2:
            gpus = [GpuAssignment(g, "rollout", stage=0, tp_rank=g, group=0, instance=0) for g in (0, 1)]
            return Machine(pool, host, gpu_type, "rollout", gpus)
        gpus = [
            GpuAssignment(g, "rollout", stage=0, tp_rank=0, group=group, instance=first + g)
            if g < n
            else GpuAssignment(g, "idle")
            for g in (0, 1)
        ]
        return Machine(pool, host, gpu_type, "rollout", gpus)

    big = (
        ReplicaGroup("big", "H100", 2, 1, 1, 0.5, 32, 1800.0, 128)
        if big_tp == 2
        else ReplicaGroup("big", "H100", 1, 1, n, 0.5, 32, 900.0, 64)
    )

    train_gpus = [GpuAssignment(g, "train", stage=0, dp_rank=g, tp_rank=0) for g in (0, 1)]
    return HexPlan(
        recipe="tests/two_type.yaml",
        model="Qwen2.5-0.5B",
        objective=Objective("max_throughput"),
        predicted=Predicted(1000.0, 10.0, 360000.0, 10.0, 6.0, 8.0, 2.0),
        train=TrainPlan({"H100": 2}, [TrainStage("big", "H100", 2, 1, 24, ["big-0"])]),
        rollout=RolloutPlan(
            {"H100": 2 if big_tp == 2 else n, "L40S": 2 * n},
            [
                big,
                ReplicaGroup("small", "L40S", 1, 1, 2 * n, 0.5, 32, 450.0, 32),
            ],
        ),
        machines=[
            Machine("big", "big-0", "H100", "train", train_gpus),
            rollout_machine("big", "big-1", "H100", 0, 0),
            rollout_machine("small", "small-0", "L40S", 1, 0),
            rollout_machine("small", "small-1", "L40S", 1, n),
        ],
        baselines={},
        solver=SolverInfo(0.1, "optimal", 1, 0.0),
        staleness=Staleness(max_head_offpolicyness=4, max_concurrent_rollouts=192),
    )


def session_of(config, plan: HexPlan):
    """The run's session as a scheduler's set-up reads it: the config, the plan and its placement (no recipe)."""
    from areal_hex_plugin.areal.rewrite import Rewrite
    from areal_hex_plugin.areal.session import HexSession
    from areal_hex_plugin.areal.worker_slots import placement_from_plan

    return HexSession(None, config, plan, "test", Rewrite(placement_from_plan(plan), "", "", ()))
