"""Issue 33, item 4: ``plan --as-written`` scores the recipe's own upstream allocation with no search, placed as
upstream places it, priced by the planner's own evaluator; the plan table shows it beside Hex's plan."""

from __future__ import annotations

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.costmodel import CostModel, RolloutStage, TrainStage
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.planner.as_written import as_upstream, parse_allocation
from areal_hex_plugin.planner.caps import recipe_caps, unmet
from areal_hex_plugin.planner.recipe_planner import (
    AS_WRITTEN,
    AS_WRITTEN_MODE,
    Planner,
    PlanRequest,
    plan_as_written,
    plan_recipe,
)
from areal_hex_plugin.planner.report import describe_plan
from areal_hex_plugin.planner.split import Split
from areal_hex_plugin.saved_plan import plan_estimates
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO
from tests.planner.helpers import recipe_with_pools

PAPER_7B = str(REPO / "recipes" / "paper" / "7b.yaml")
TRAIN = ("fsdp", "megatron")


@pytest.mark.parametrize(
    ("text", "kinds", "shape"),
    [
        ("fsdp:d8", TRAIN, ("fsdp", 8, 1, 1)),
        ("megatron:d4p2t1", TRAIN, ("megatron", 4, 2, 1)),
        ("megatron:t2 d4 p3", TRAIN, ("megatron", 4, 3, 2)),
        ("megatron[actor]:d2p2", TRAIN, ("megatron", 2, 2, 1)),
        ("sglang:d4p1t2", ("sglang",), ("sglang", 4, 1, 2)),
        ("sglang:t8", ("sglang",), ("sglang", 1, 1, 8)),
    ],
)
def test_upstream_allocation_strings_parse_as_upstream_reads_them(text, kinds, shape):
    a = parse_allocation(text, "rollout.backend" if kinds == ("sglang",) else "actor.backend", kinds)
    assert (a.kind, a.dp, a.pp, a.tp) == shape and a.gpus == shape[1] * shape[2] * shape[3]


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("fsdp:d4p2", "actor.backend", "no pipeline parallelism"),
        ("archon:d4", "actor.backend", "not one Hex scores"),
        ("vllm:d4", "rollout.backend", "not one Hex scores"),
        ("sglang", "rollout.backend", "not an upstream allocation"),
        ("fsdp:d0", "actor.backend", "not an upstream allocation"),
        ("megatron:d2d4", "actor.backend", "gives d twice"),
        ("megatron:d2c2", "actor.backend", "context or expert parallelism"),
        ("sglang:d2x2", "rollout.backend", "dimension 'x'"),
    ],
)
def test_bad_allocation_strings_name_the_field(text, field, words):
    kinds = ("sglang",) if field == "rollout.backend" else TRAIN
    with pytest.raises(HexError) as err:
        parse_allocation(text, field, kinds)
    assert err.value.field == field and words in str(err.value) and err.value.fix


def test_fsdp_as_written_scores_what_the_evaluator_scores_for_the_same_layout():
    """fsdp:d16 + 4 x tp2 servers on three 8-GPU machines: the search's evaluator, forced to that split and that
    server shape, finds the same layout and the same step by its own route (train search, fleet knapsack)."""
    recipe = recipe_with_pools(
        [("H800-PCIe", 8, 3)], "7b", "actor.backend=fsdp:d16", "rollout.backend=sglang:d4p1t2",
        "hex.solver.rollout_layout=[2,1]",
    )  # fmt: skip
    plan = plan_as_written(recipe)
    assert [(s.pool, s.dp, s.tp, s.hosts) for s in plan.train.stages] == [("p0", 16, 1, ["p0-0", "p0-1"])]
    assert [(g.pool, g.tp, g.pp, g.count) for g in plan.rollout.replicas] == [("p0", 2, 1, 4)]
    assert (
        plan.solver.mode == AS_WRITTEN_MODE and plan.baselines == {} and plan.binding_constraint is not None
    )
    ev = as_upstream(Planner(recipe, PlanRequest()).ev)
    searched = ev.evaluate(Split((2,), (1,)))
    assert searched.train.stages == (TrainStage("p0", 16, 1),)
    assert [(c.tp, c.pp, n) for c, n in searched.fleet.groups] == [(2, 1, 4)]
    assert plan.predicted.tokens_per_s == pytest.approx(searched.tokens_per_s(ev.tokens_per_step), rel=1e-6)
    assert plan.predicted.cost_per_hour == pytest.approx(searched.cost_per_hour)
    # Upstream's settings as written: weights after every step, admission at rollout.max_concurrent_rollouts.
    assert plan.solver.window_steps == 1
    assert plan.staleness.max_concurrent_rollouts == recipe.workload.rl.max_concurrent_rollouts


def test_megatron_pipeline_as_written_takes_the_pools_in_order_each_stage_on_one_type():
    recipe = load_recipe(
        PAPER_7B, ["actor.backend=megatron:d16p3t1", "rollout.backend=sglang:d2p2t2", "hex.objective.budget_per_hour=null"]
    )  # fmt: skip
    plan = plan_as_written(recipe)
    stages = [(s.pool, s.dp, s.tp, s.hosts) for s in plan.train.stages]
    assert stages == [
        ("h800", 16, 1, ["h800-0", "h800-1"]),
        ("h800", 16, 1, ["h800-2", "h800-3"]),
        ("h20", 16, 1, ["h20-0", "h20-1"]),
    ]
    assert [(g.pool, g.tp, g.pp, g.count) for g in plan.rollout.replicas] == [("h20", 2, 2, 2)]
    assert [m.host for m in plan.machines if m.role == "rollout"] == ["h20-2"]
    assert unmet(plan, recipe_caps(recipe)) == {}
    # Each phase is the cost model's for that layout, priced as a Megatron actor (one stage would be too).
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    assert cm.workload.rl.megatron
    train = cm.train(tuple(TrainStage(p, dp, tp) for p, dp, tp, _ in stages))
    assert plan.predicted.train_time_s == pytest.approx(train.step_time_s, rel=1e-4)
    assert [s.layers for s in plan.train.stages] == list(train.layers)
    group = plan.rollout.replicas[0]
    replica = cm.rollout((RolloutStage("h20", 2), RolloutStage("h20", 2)), group.concurrency)
    assert group.tokens_per_s == pytest.approx(replica.tokens_per_s, rel=1e-6)
    plan_estimates(cm, plan)  # a saved copy of it passes the checks simulate and the driver run


def test_a_partly_filled_machine_serves_rollout_beside_training_except_on_slurm():
    sets = ["actor.backend=fsdp:d4", "rollout.backend=sglang:d3p1t1", "hex.objective.budget_per_hour=null"]
    plan = plan_as_written(load_recipe(PAPER_7B, sets))
    first = plan.machines[0]
    assert first.role == "split" and [a.role for a in first.gpus] == ["train"] * 4 + ["rollout"] * 3 + [
        "idle"
    ]
    slurm = plan_as_written(load_recipe(PAPER_7B, [*sets, "scheduler.type=hex_slurm"]))
    assert [m.role for m in slurm.machines[:2]] == ["train", "rollout"]
    assert slurm.predicted.cost_per_hour > plan.predicted.cost_per_hour


@pytest.mark.parametrize(
    ("override", "field", "words"),
    [
        ("actor.backend=fsdp:d512", "actor.backend", "needs 512 GPUs; the cluster has 104"),
        ("actor.backend=megatron:d24p2", "actor.backend", "past the 32 GPUs of pool h800"),
        ("actor.backend=fsdp:d1", "actor.backend", "GB usable"),
        ("rollout.backend=sglang:d2p1t16", "rollout.backend", "packs no machine"),
        ("rollout.backend=sglang:d100p1t8", "rollout.backend", "lower d to 12 or less"),
        # Megatron's state is whole on every dp rank: 7B on 8 x 80 GB does not fit as one stage.
        ("actor.backend=megatron:d8", "actor.backend", "GB usable"),
        # What the runtime cannot start: upstream's Megatron xccl path keeps servers at pp 1.
        (
            "actor.backend=megatron:d4t2 rollout.backend=sglang:d2p2t1 hex.transport=upstream",
            "rollout.backend",
            "needs train pp = rollout pp",
        ),
    ],
)
def test_a_shape_that_does_not_fit_exits_2_naming_it(capsys, override, field, words):
    assert main(["plan", PAPER_7B, "--as-written", *override.split()]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("scoring ")]
    assert (
        lines[0].startswith(f"error: {field}") and words in err and "fix:" in err and "Traceback" not in err
    )


def test_as_written_refuses_the_flags_that_search(capsys):
    assert main(["plan", PAPER_7B, "--as-written", "--pareto"]) == 2
    assert "error: --pareto" in capsys.readouterr().err


def test_the_plan_table_shows_the_allocation_as_written_beside_hex_and_the_baselines():
    sets = ["actor.backend=fsdp:d8", "rollout.backend=sglang:d4p1t2"]
    recipe = recipe_with_pools([("H800-PCIe", 8, 2), ("H20", 8, 3)], "7b", "hex.solver.time_limit_s=5", *sets)
    plan = plan_recipe(recipe)
    written = plan_as_written(recipe)
    row = plan.baselines[AS_WRITTEN]
    assert row.tokens_per_s == pytest.approx(written.predicted.tokens_per_s, rel=1e-6)
    assert row.cost_per_hour == pytest.approx(written.predicted.cost_per_hour)
    # Its interval is the as-written plan's (issue 33, planner/interval.py).
    w = written.predicted
    assert (row.tokens_per_s_low, row.tokens_per_s_high) == pytest.approx(
        (w.tokens_per_s_low, w.tokens_per_s_high)
    )
    assert w.tokens_per_s_low < w.tokens_per_s < w.tokens_per_s_high
    assert "fsdp:d8 + sglang:d4p1t2" in row.note and row.tokens_per_s <= plan.predicted.tokens_per_s
    assert any(line.startswith("as-written ") for line in describe_plan(plan).splitlines())
    # Backends that do not fit the cluster are no shape to show.
    unfit = recipe_with_pools(
        [("H800-PCIe", 8, 2)], "7b", "hex.solver.time_limit_s=5", "actor.backend=fsdp:d64"
    )
    assert AS_WRITTEN not in plan_recipe(unfit).baselines
    # Nor are shapes the runtime cannot start (upstream's Megatron xccl path keeps servers at pp 1).
    xccl = recipe_with_pools(
        [("H800-PCIe", 8, 2)], "7b", "hex.solver.time_limit_s=5", "hex.transport=upstream",
        "actor.backend=megatron:d4t2", "rollout.backend=sglang:d2p2t1",
    )  # fmt: skip
    assert AS_WRITTEN not in plan_recipe(xccl).baselines


def test_the_plan_never_loses_to_the_recipes_allocation_within_the_budget():
    """A search kept to one training stage (hex.solver.max_pp_stages=1) loses to a two-stage Megatron allocation as
    written: the allocation is the plan then, said so."""
    recipe = recipe_with_pools(
        [("H100", 8, 8)], "14b", "++hex.workload.model=Qwen2.5-32B", "actor.backend=megatron:d4p2t4",
        "rollout.backend=sglang:d8p1t4", "hex.solver.time_limit_s=10", "hex.solver.max_pp_stages=1",
    )  # fmt: skip
    planner = Planner(recipe, PlanRequest())
    written = planner.as_written()[0].tokens_per_s(planner.ev.tokens_per_step)
    plan = planner.solve()
    assert plan.predicted.tokens_per_s == pytest.approx(written, rel=1e-6)
    assert [(s.dp, s.tp) for s in plan.train.stages] == [(4, 4), (4, 4)]
    assert any("allocation as written beats" in w for w in plan.warnings)
