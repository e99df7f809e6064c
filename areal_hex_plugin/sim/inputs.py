"""Turn a recipe and a HexPlan into a :class:`SimSpec`, with every cost taken from the cost model.

The cost model gives a replica's decode step at one concurrency (its full batch); the simulator needs the step
as a function of the sequences in flight. It is read here from public :class:`RolloutEstimate` results only: the
same replica is estimated with at most 1, 2, 4, ... sequences in flight and with its planned batch
(``CostModel.rollout(stages, max_sequences=n)``), and the step times in between are interpolated linearly, so
``n / step(n)`` at the planned batch is exactly the model's ``peak_tokens_per_s``. Drain, prefill and staleness effects, which the model averages analytically, are then
played out by the simulation itself.

Prefill (new prompts, and the KV recompute after each weight update) runs at the model's own compute-bound
prefill rate (``RolloutEstimate.prefill_s_per_token``), the same figure the planner charges.
"""

from __future__ import annotations

from areal_hex_plugin.costmodel import CostModel, RolloutStage
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.planner.refit_replan import plan_layout
from areal_hex_plugin.saved_plan import plan_estimates
from areal_hex_plugin.sim.spec import LaneSpec, SimSpec


def sim_spec(recipe, plan: HexPlan) -> SimSpec:
    """The simulation inputs of ``plan`` on ``recipe``'s cluster and workload."""
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    workload = recipe.workload
    if not plan.rollout.replicas or not plan.train.stages:
        raise HexError(
            "plan.rollout.replicas" if not plan.rollout.replicas else "plan.train.stages",
            "is empty: a plan needs rollout replicas and a trainer to simulate",
            "re-plan the recipe: areal-hex plan RECIPE --json PLAN.json",
        )
    estimates, train = plan_estimates(cm, plan)
    layout = plan_layout(plan, recipe.hex.transport)
    lanes = []
    for i, (group, full) in enumerate(zip(plan.rollout.replicas, estimates, strict=True)):
        stages = tuple(RolloutStage(pool=group.pool, tp=group.tp) for _ in range(group.pp))
        lanes.append(
            LaneSpec(
                name=_lane_name(group, i, plan),
                pool=group.pool,
                gpus_per_replica=group.tp * group.pp,
                count=group.count,
                share=group.share,
                step_s=_step_table(cm, stages, min(group.concurrency, full.concurrency)),
                prefill_tokens_per_s=1 / full.prefill_s_per_token,
            )
        )
    train_gpus: dict[str, int] = {}
    for s in layout.train:
        train_gpus[s.pool] = train_gpus.get(s.pool, 0) + s.n_gpus
    rl = workload.rl
    return SimSpec(
        lanes=tuple(lanes),
        lengths=workload.output_lengths.lengths,
        prompt_tokens=workload.prompt_tokens,
        n_samples=rl.n_samples,
        batch=rl.batch_size,
        consumer_batch=rl.consumer_batch_size,
        max_staleness=rl.max_head_offpolicyness,
        # Upstream's RolloutController falls back to the consumer batch size when the limit is unset.
        max_concurrent_rollouts=plan.staleness.max_concurrent_rollouts or rl.consumer_batch_size,
        train_s=train.step_time_s,
        sync_s=layout.sync_s(cm),
        train_gpus=train_gpus,
        reward_s_per_sample=workload.reward_cpu_s_per_sample,
        reward_workers=workload.reward_cpus,
        update_interval=plan.solver.window_steps,
    )


def _step_table(cm: CostModel, stages: tuple[RolloutStage, ...], concurrency: int) -> tuple[float, ...]:
    """Decode step seconds for 1 .. ``concurrency`` sequences: the model at 1, 2, 4, ... and ``concurrency``,
    linear in between."""

    def point(n: int) -> tuple[int, float]:
        estimate = cm.rollout(stages, max_sequences=n)
        return estimate.concurrency, estimate.step_time_s

    points = []
    n = 1
    while n < concurrency:
        points.append(point(n))
        n *= 2
    points.append(point(concurrency))
    table = []
    for (n0, s0), (n1, s1) in zip(points, points[1:], strict=False):
        table += [s0 + (s1 - s0) * (n - n0) / (n1 - n0) for n in range(n0, n1)]
    table.append(points[-1][1])
    return tuple(table)


def _lane_name(group, index: int, plan: HexPlan) -> str:
    shape = f"PP{group.pp}xTP{group.tp}" if group.pp > 1 else f"TP{group.tp}"
    twins = [g for g in plan.rollout.replicas if (g.pool, g.tp, g.pp) == (group.pool, group.tp, group.pp)]
    return f"{group.pool} {shape}" + (f" (group {index})" if len(twins) > 1 else "")
