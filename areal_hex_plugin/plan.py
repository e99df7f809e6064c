"""HexPlan: the one contract between the scheduler, the simulator, the AReaL integration and the CLI.

A plan is plain data: which machine does what (``machines`` lists EVERY machine of the inventory, and per GPU
what it serves), the training layout, the rollout replica groups with their workload shares, the predicted step
breakdown, the baselines it was compared with and how the solver fared. It is saved as versioned JSON; loading a
file of another version, or a malformed one, raises :class:`HexError`.

Units: seconds, tokens per second, $ per hour. GPU ids are local to their machine (0 .. gpus_per_machine - 1).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs import typed

SCHEMA_VERSION = 1
ROLES = ("train", "rollout", "idle")


@dataclass(frozen=True)
class Predicted:
    """The paper's metric: tokens per step / (weight sync + max(rollout incl. reward, train))."""

    tokens_per_s: float
    cost_per_hour: float
    tokens_per_dollar: float
    step_time_s: float
    train_time_s: float
    rollout_time_s: float  # generation plus reward, per step
    weight_sync_s: float
    reward_s: float = 0.0


@dataclass(frozen=True)
class TrainStage:
    """One pipeline stage: ``dp`` x ``tp`` GPUs of one type, holding ``layers`` transformer layers."""

    pool: str
    gpu_type: str
    dp: int
    tp: int
    layers: int
    hosts: list[str]


@dataclass(frozen=True)
class TrainPlan:
    gpus: dict[str, int]  # GPU type -> GPUs training
    stages: list[TrainStage]
    memory_gb_per_gpu: float = 0.0


@dataclass(frozen=True)
class ReplicaGroup:
    """``count`` identical rollout replicas: ``pp`` stages of ``tp`` GPUs, each stage inside one machine.

    ``share`` is the fraction of a step's samples the whole group generates (x_psi / B), ``samples_per_step``
    the same as a whole number (largest-remainder rounding), ``tokens_per_s`` one replica's predicted speed and
    ``concurrency`` the requests one replica keeps in flight.
    """

    pool: str
    gpu_type: str
    tp: int
    pp: int
    count: int
    share: float
    samples_per_step: int
    tokens_per_s: float
    concurrency: int


@dataclass(frozen=True)
class RolloutPlan:
    gpus: dict[str, int]  # GPU type -> GPUs generating
    replicas: list[ReplicaGroup]


@dataclass(frozen=True)
class GpuAssignment:
    """What one GPU serves: train stage ``stage`` (dp_rank, tp_rank), or rollout replica group ``group``,
    instance ``instance``, pipeline stage ``stage`` (tp_rank); or nothing (idle)."""

    gpu: int
    role: str
    stage: int | None = None
    dp_rank: int | None = None
    tp_rank: int | None = None
    group: int | None = None
    instance: int | None = None


@dataclass(frozen=True)
class Machine:
    pool: str
    host: str
    gpu_type: str
    role: str  # train | rollout | idle
    gpus: list[GpuAssignment]


@dataclass(frozen=True)
class Baseline:
    tokens_per_s: float
    cost_per_hour: float
    gpus: dict[str, int]
    note: str = ""


@dataclass(frozen=True)
class SolverInfo:
    solve_time_s: float
    status: str  # optimal | feasible | timeout | single_type
    iterations: int
    gap: float  # relative gap to the best bound known (0 when proven optimal)
    mode: str = "two_phase"  # two_phase | exhaustive
    window_steps: int = 1  # the δ(η) window the costs were averaged over


@dataclass(frozen=True)
class Staleness:
    """Upstream's admission settings; ``max_concurrent_rollouts`` counts rollouts (prompts), as upstream does."""

    max_head_offpolicyness: int
    max_concurrent_rollouts: int


@dataclass(frozen=True)
class ParetoPoint:
    cost_per_hour: float
    tokens_per_s: float
    gpus: dict[str, int]


@dataclass(frozen=True)
class Objective:
    kind: str  # max_throughput | budget | target
    budget_per_hour: float | None = None
    target_tokens_per_s: float | None = None


@dataclass(frozen=True)
class HexPlan:
    recipe: str
    model: str
    objective: Objective
    predicted: Predicted
    train: TrainPlan
    rollout: RolloutPlan
    machines: list[Machine]
    baselines: dict[str, Baseline]
    solver: SolverInfo
    staleness: Staleness
    binding: str = ""  # the constraint that limits throughput, in words
    pool_roles: dict[str, str] = field(default_factory=dict)  # pool -> why it got its role
    pareto: list[ParetoPoint] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {"schema_version": data.pop("schema_version"), **data}

    @staticmethod
    def from_dict(data: Any, source: str = "plan") -> HexPlan:
        if not isinstance(data, dict):
            raise HexError(
                source,
                f"must be a JSON object, got {type(data).__name__}",
                "give a plan written by areal-hex plan --json",
            )
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise HexError(
                f"{source}.schema_version",
                f"is {version!r}, this areal-hex reads version {SCHEMA_VERSION}",
                "re-create the plan with this version: areal-hex plan RECIPE --json OUT",
            )
        plan = typed.build(HexPlan, data, source, strict=True)
        _check(plan, source)
        return plan

    def save(self, path: str | Path) -> Path:
        from areal_hex_plugin.outfiles import write_json

        return write_json(path, self.to_dict())

    @staticmethod
    def load(path: str | Path) -> HexPlan:
        file = Path(path).expanduser()
        try:
            text = file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise HexError(
                "plan", f"cannot read {file}: {exc}", "give the path of a plan JSON file"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise HexError(
                "plan", f"{file} is not JSON ({exc.msg} at line {exc.lineno})", "re-create the plan"
            ) from None
        return HexPlan.from_dict(data, "plan")

    def machines_with_role(self, role: str) -> list[Machine]:
        """The machines that train, generate or stay idle (``role`` in :data:`ROLES`)."""
        return [m for m in self.machines if m.role == role]


def _check(plan: HexPlan, source: str) -> None:
    """Cross-field checks a consumer relies on: roles are known and every referenced stage/group exists."""
    n_stages = len(plan.train.stages)
    n_groups = len(plan.rollout.replicas)
    for i, stage in enumerate(plan.train.stages):
        for name in ("dp", "tp", "layers"):
            if getattr(stage, name) < 1:
                raise HexError(
                    f"{source}.train.stages[{i}].{name}", "must be at least 1", "re-create the plan"
                )
    for i, group in enumerate(plan.rollout.replicas):
        for name in ("tp", "pp", "count", "concurrency"):
            if getattr(group, name) < 1:
                raise HexError(
                    f"{source}.rollout.replicas[{i}].{name}", "must be at least 1", "re-create the plan"
                )
        if not 0 <= group.share <= 1:
            raise HexError(f"{source}.rollout.replicas[{i}].share", "must be in [0, 1]", "re-create the plan")
    if plan.rollout.replicas and not any(g.share > 0 for g in plan.rollout.replicas):
        raise HexError(f"{source}.rollout.replicas", "every share is 0", "re-create the plan")
    for i, machine in enumerate(plan.machines):
        where = f"{source}.machines[{i}]"
        if machine.role not in ROLES:
            raise HexError(
                f"{where}.role", f"unknown role {machine.role!r}", f"use one of {', '.join(ROLES)}"
            )
        for j, gpu in enumerate(machine.gpus):
            if gpu.role not in ROLES:
                raise HexError(
                    f"{where}.gpus[{j}].role", f"unknown role {gpu.role!r}", f"use one of {', '.join(ROLES)}"
                )
            if gpu.role == "train" and not (gpu.stage is not None and 0 <= gpu.stage < n_stages):
                raise HexError(
                    f"{where}.gpus[{j}].stage", f"no train stage {gpu.stage!r}", "re-create the plan"
                )
            if gpu.role == "rollout" and not (gpu.group is not None and 0 <= gpu.group < n_groups):
                raise HexError(
                    f"{where}.gpus[{j}].group", f"no replica group {gpu.group!r}", "re-create the plan"
                )
