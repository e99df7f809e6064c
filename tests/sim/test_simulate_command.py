"""``areal-hex simulate`` end to end on a shipped recipe, with a saved plan; bad input exits 2."""

from __future__ import annotations

import json

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.costmodel import CostModel, RolloutStage
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.saved_plan import load_saved_plan
from areal_hex_plugin.sim.inputs import sim_spec
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO

RECIPE = REPO / "recipes" / "paper" / "1.5b.yaml"


@pytest.fixture(scope="module")
def planned():
    recipe = load_recipe(RECIPE, [])
    return recipe, plan_recipe(recipe)


def test_step_table_follows_the_cost_model(planned):
    recipe, plan = planned
    spec = sim_spec(recipe, plan)
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    for group, lane in zip(plan.rollout.replicas, spec.lanes, strict=True):
        stages = tuple(RolloutStage(group.pool, group.tp) for _ in range(group.pp))
        estimate = cm.rollout(stages, max_sequences=group.concurrency)  # the plan's batch per replica
        assert lane.max_running == estimate.concurrency
        assert lane.tokens_per_s(estimate.concurrency) == pytest.approx(estimate.peak_tokens_per_s, rel=1e-9)
        # More sequences: each step takes longer, but the replica generates more in total.
        assert all(a <= b for a, b in zip(lane.step_s, lane.step_s[1:], strict=False))
        assert lane.tokens_per_s(estimate.concurrency // 4) < estimate.peak_tokens_per_s
        # Prefill (new prompts and the rebuild after an update) at the planner's rate, and compute-bound: faster
        # per token than decoding a single sequence.
        assert lane.prefill_tokens_per_s == pytest.approx(1 / estimate.prefill_s_per_token, rel=1e-9)
        assert 1 / lane.step_s[0] < lane.prefill_tokens_per_s
    assert spec.train_s == pytest.approx(plan.predicted.train_time_s, rel=1e-3)
    assert spec.update_interval == plan.solver.window_steps
    assert spec.sync_s / spec.update_interval == pytest.approx(plan.predicted.weight_sync_s, rel=1e-3)


def test_simulate_with_a_saved_plan_writes_json_and_timelines(planned, tmp_path, capsys):
    _, plan = planned
    plan_file = plan.save(tmp_path / "plan.json")
    out = tmp_path / "sim.json"
    code = main(
        [
            "simulate",
            str(RECIPE),
            "--plan",
            str(plan_file),
            "--steps",
            "6",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "t.png"),
        ]  # fmt: skip
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert data["steps"] == 6 and data["tokens_per_s"] > 0
    assert set(data["breakdown_s"]) == {"rollout_wait", "train", "sync", "rollout_idle"}
    assert sum(data["staleness_histogram"].values()) == 6 * plan_samples(planned[0])
    assert [p.name for p in tmp_path.glob("t*.png")] == ["t.png"]  # every pool's timeline in one figure
    assert "simulated" in capsys.readouterr().out


def test_a_plan_for_another_cluster_exits_2_naming_the_pool(planned, tmp_path, capsys):
    _, plan = planned
    plan_file = plan.save(tmp_path / "plan.json")
    other = REPO / "recipes" / "mixes" / "a100_l40s_qwen2.5-7b.yaml"
    same_model = "actor.path=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    assert main(["simulate", str(other), same_model, "--plan", str(plan_file), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: plan.train.stages[0].pool: the plan uses pool 'h800'"), err


def test_a_plan_for_another_model_exits_2(planned, tmp_path, capsys):
    _, plan = planned
    plan_file = plan.save(tmp_path / "plan.json")
    other = REPO / "recipes" / "paper" / "7b.yaml"
    assert main(["simulate", str(other), "--plan", str(plan_file), "--steps", "2"]) == 2
    assert "made for model DeepSeek-R1-Distill-Qwen-1.5B" in capsys.readouterr().err


def test_without_kv_recompute_no_slower(planned, tmp_path):
    _, plan = planned
    plan_file = plan.save(tmp_path / "plan.json")
    runs = {}
    for flag in ([], ["--no-kv-recompute"]):
        out = tmp_path / f"sim{len(flag)}.json"
        assert (
            main(
                ["simulate", str(RECIPE), "--plan", str(plan_file), "--steps", "8", "--json", str(out), *flag]
            )
            == 0
        )
        runs[bool(flag)] = json.loads(out.read_text())
    assert runs[True]["kv_recompute"] is False and runs[False]["kv_recompute"] is True
    assert runs[True]["simulated_step_s"] <= runs[False]["simulated_step_s"]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["predicted"].update(tokens_per_s=0), "plan.predicted.tokens_per_s"),
        (lambda d: d["predicted"].update(step_time_s=0), "plan.predicted.step_time_s"),
        (
            lambda d: [g.update(share=g["share"] / 2) for g in d["rollout"]["replicas"]],
            "plan.rollout.replicas",
        ),
        (lambda d: d.update(runtime=""), "plan.runtime"),
    ],
)
def test_a_saved_plan_no_planner_writes_exits_2_naming_the_field(planned, tmp_path, capsys, edit, field):
    """Found by fuzzing: a plan predicting 0 tokens/s ended simulate in a ZeroDivisionError; one whose shares sum
    to 0.5, or with no runtime, was taken."""
    data = planned[1].to_dict()
    edit(data)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(data))
    assert main(["simulate", str(RECIPE), "--plan", str(plan_file), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field}:") and "areal-hex plan" in err and "Traceback" not in err, err


def test_a_saved_plans_explanations_are_not_taken_from_the_file(planned, tmp_path):
    """The planner's explanations (why each pool got its role, the binding constraint, the sensitivity, the
    frontier) are output only: nothing recomputes them from a saved plan, so a loaded plan carries none."""
    recipe, plan = planned
    data = plan.to_dict()
    data["pool_roles"] = {pool: "forged" for pool in data["pool_roles"]}
    data["binding"] = "forged"
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(data))
    loaded = load_saved_plan(plan_file, recipe, "--plan")
    assert (loaded.pool_roles, loaded.pool_role_reasons, loaded.binding, loaded.binding_constraint) == (
        {},
        {},
        "",
        None,
    )
    assert (loaded.sensitivity, loaded.pareto, loaded.alternatives) == (None, [], {})
    assert loaded.machines == plan.machines and loaded.rollout == plan.rollout


def plan_samples(recipe) -> int:
    return recipe.workload.rl.samples_per_step


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--steps", "0"], "--steps"),
        (["--plan", "/nonexistent/plan.json"], "plan"),
        (["--json", "/dev/null/out.json"], "--json"),
    ],
)
def test_bad_input_exits_2_with_the_field(argv, field, tmp_path, capsys):
    assert main(["simulate", str(RECIPE), *argv]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err
