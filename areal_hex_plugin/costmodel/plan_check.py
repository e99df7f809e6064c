"""Whether a plan's layouts run on a recipe, by the cost model.

The planner only builds layouts the cost model finds feasible (the TP degree divides the attention heads, the
weights leave room for a KV cache, the training state fits); a plan read from a file (``simulate --plan``,
``hex.plan_path``, perhaps edited by hand) passes the same check before anything uses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_hex_plugin.costmodel.model import CostModel
from areal_hex_plugin.costmodel.rollout import RolloutEstimate, RolloutStage
from areal_hex_plugin.costmodel.train import TrainEstimate, TrainStage
from areal_hex_plugin.errors import HexError

if TYPE_CHECKING:
    from areal_hex_plugin.plan import HexPlan


def plan_estimates(
    cm: CostModel, plan: HexPlan, source: str = "plan"
) -> tuple[list[RolloutEstimate], TrainEstimate]:
    """Each replica group's estimate (its full batch) and the training layout's; HexError names the first
    group or the trainer that does not run, and why."""
    rollout = []
    for i, group in enumerate(plan.rollout.replicas):
        estimate = cm.rollout(tuple(RolloutStage(pool=group.pool, tp=group.tp) for _ in range(group.pp)))
        if not estimate.feasible:
            raise HexError(
                f"{source}.rollout.replicas[{i}]",
                f"tp{group.tp} pp{group.pp} on {group.gpu_type} does not run on this recipe: {estimate.reason}",
                "re-plan the recipe (areal-hex plan RECIPE --json PLAN), or edit the group to a layout that runs",
            )
        rollout.append(estimate)
    train = cm.train(tuple(TrainStage(s.pool, s.dp, s.tp, s.hybrid) for s in plan.train.stages))
    if not train.feasible:
        raise HexError(
            f"{source}.train", f"does not run on this recipe: {train.reason}", "re-plan the recipe"
        )
    return rollout, train
