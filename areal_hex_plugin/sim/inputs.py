"""Turn a recipe and a HexPlan into a :class:`SimSpec`, with every cost taken from the cost model.

The cost model gives a replica's decode step at one concurrency (its full batch); the simulator needs the step
as a function of the sequences in flight. It is derived here from public :class:`RolloutEstimate` results only:
the same replica estimated with one sequence in flight (``max_concurrent_rollouts = 1``) and with its full batch
pin a straight line ``step(n) = fixed + per_seq * n`` (weights read once per step, per-sequence work on top), so
``n / step(n)`` at the full batch is exactly the model's ``peak_tokens_per_s``. Drain, prefill and staleness
effects, which the model averages analytically, are then played out by the simulation itself. Prefill (new
prompts and the KV recompute after each weight update) costs the per-sequence slope of the same line measured
with a near-empty context (1-token prompt and outputs), i.e. one token's dense work.
"""

from __future__ import annotations

from dataclasses import replace

from areal_hex_plugin.costmodel import CostModel, RolloutStage, TrainStage, recipe_calibration
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.sim.spec import LaneSpec, SimSpec
from areal_hex_plugin.specs.workload import LengthDistribution


def sim_spec(recipe, plan: HexPlan, cost_model: CostModel | None = None) -> SimSpec:
    """The simulation inputs of ``plan`` on ``recipe``'s cluster and workload."""
    calibration = recipe_calibration(recipe)
    cm = cost_model or CostModel(recipe.cluster, recipe.workload, calibration)
    workload = recipe.workload
    if not plan.rollout.replicas or not plan.train.stages:
        raise HexError(
            "plan.rollout.replicas" if not plan.rollout.replicas else "plan.train.stages",
            "is empty: a plan needs rollout replicas and a trainer to simulate",
            "re-plan the recipe: areal-hex plan RECIPE --json PLAN.json",
        )
    one = CostModel(recipe.cluster, _with_concurrency(workload, 1), calibration)
    empty = _near_empty_context(workload)
    empty_one = CostModel(recipe.cluster, _with_concurrency(empty, 1), calibration)
    lanes = []
    replicas = []
    for i, group in enumerate(plan.rollout.replicas):
        stages = tuple(RolloutStage(pool=group.pool, tp=group.tp) for _ in range(group.pp))
        full = cm.rollout(stages)
        if not full.feasible:
            raise HexError(
                f"plan.rollout.replicas[{i}]",
                f"does not run on this recipe: {full.reason}",
                "re-plan the recipe",
            )
        fixed, per_seq = _step_line(full.step_time_s, full.concurrency, one.rollout(stages).step_time_s)
        dense = CostModel(recipe.cluster, _with_concurrency(empty, full.concurrency), calibration).rollout(
            stages
        )
        _, prefill_per_token = _step_line(
            dense.step_time_s, dense.concurrency, empty_one.rollout(stages).step_time_s
        )
        lanes.append(
            LaneSpec(
                name=_lane_name(group, i, plan),
                pool=group.pool,
                gpus_per_replica=group.tp * group.pp,
                count=group.count,
                share=group.share,
                max_running=group.concurrency,
                step_fixed_s=fixed,
                step_per_seq_s=per_seq,
                prefill_tokens_per_s=1.0 / prefill_per_token,
            )
        )
        replicas.append((stages, group.count))
    train_stages = tuple(TrainStage(pool=s.pool, dp=s.dp, tp=s.tp) for s in plan.train.stages)
    train = cm.train(train_stages)
    if not train.feasible:
        raise HexError("plan.train", f"does not run on this recipe: {train.reason}", "re-plan the recipe")
    train_gpus: dict[str, int] = {}
    for s in train_stages:
        train_gpus[s.pool] = train_gpus.get(s.pool, 0) + s.n_gpus
    strategy = "relay" if recipe.hex.transport == "relay" else "broadcast"
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
        sync_s=cm.weight_sync(train_gpus, replicas, strategy).seconds,
        train_gpus=train_gpus,
        reward_s_per_sample=workload.reward_cpu_s_per_sample,
        reward_workers=workload.reward_cpus,
    )


def _lane_name(group, index: int, plan: HexPlan) -> str:
    shape = f"PP{group.pp}xTP{group.tp}" if group.pp > 1 else f"TP{group.tp}"
    twins = [g for g in plan.rollout.replicas if (g.pool, g.tp, g.pp) == (group.pool, group.tp, group.pp)]
    return f"{group.pool} {shape}" + (f" (group {index})" if len(twins) > 1 else "")


def _with_concurrency(workload, limit: int):
    return replace(workload, rl=replace(workload.rl, max_concurrent_rollouts=limit))


def _near_empty_context(workload):
    return replace(
        workload, prompt_tokens=1, output_lengths=LengthDistribution((1,), "one token (dense-work probe)")
    )


def _step_line(step_full_s: float, concurrency: int, step_one_s: float) -> tuple[float, float]:
    """(fixed, per-sequence) seconds of a decode step through (1, step_one_s) and (concurrency, step_full_s)."""
    if concurrency <= 1:
        return 0.0, step_full_s
    per_seq = max(0.0, (step_full_s - step_one_s) / (concurrency - 1))
    return step_full_s - per_seq * concurrency, per_seq
