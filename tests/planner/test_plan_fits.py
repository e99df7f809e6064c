"""Issue 16: a saved plan is checked against its recipe before anything uses it, and every number in it is
finite and in range. Each example of the mutation run ends in exit 2 naming the plan field and the fix."""

from __future__ import annotations

import json

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO

RECIPE = REPO / "recipes" / "paper" / "1.5b.yaml"


@pytest.fixture(scope="module")
def plan_dict():
    return plan_recipe(load_recipe(RECIPE)).to_dict()


def _set(path: str, value):
    def edit(plan: dict) -> None:
        *parents, leaf = path.split(".")
        node = plan
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(leaf) if isinstance(node, list) else leaf] = value

    return edit


def _other_pool(path: str):
    """Move the group at ``path`` to the paper cluster's other pool (whichever the plan put it on)."""

    def edit(plan: dict) -> None:
        group = plan["rollout"]["replicas"][int(path.split(".")[-1])]
        group["pool"] = "h800" if group["pool"] == "h20" else "h20"

    return edit


def _first_rollout_machine(edit):
    def apply(plan: dict) -> None:
        index = next(i for i, m in enumerate(plan["machines"]) if m["role"] == "rollout")
        edit(plan["machines"][index])

    return apply


# (id, edit of the saved plan, field the message names)
REFUSED = [
    ("pp-1e15", _set("rollout.replicas.0.pp", 10**15), "plan.rollout.replicas[0].pp"),
    ("count-1e15", _set("rollout.replicas.0.count", 10**15), "plan.rollout.replicas[0].count"),
    ("count-beyond-the-pool", _set("rollout.replicas.0.count", 1000), "plan.machines"),
    ("pp-beyond-the-model", _set("rollout.replicas.0.pp", 100), "plan.rollout.replicas[0].pp"),
    ("gpu-index-999", _set("machines.0.gpus.0.gpu", 999), "plan.machines[0].gpus[0].gpu"),
    ("gpu-index-beyond-machine", _set("machines.0.gpus.0.gpu", 12), "plan.machines[0].gpus[0].gpu"),
    ("gpu-index-twice", _set("machines.0.gpus.1.gpu", 0), "plan.machines[0].gpus"),
    ("layers-1000", _set("train.stages.0.layers", 1000), "plan.train.stages"),
    ("layers-2000", _set("train.stages.0.layers", 2000), "plan.train.stages[0].layers"),
    ("layers-not-the-models", _set("train.stages.0.layers", 20), "plan.train.stages"),
    ("ghost-host", _set("machines.0.host", "ghost-host"), "plan.machines[0].host"),
    ("host-twice", _first_rollout_machine(lambda m: m.update(host="h800-0")), "plan.machines"),
    ("unknown-replica-pool", _set("rollout.replicas.0.pool", "a100"), "plan.rollout.replicas[0].pool"),
    (
        "replica-on-another-pool",
        _other_pool("rollout.replicas.0"),
        "plan.rollout.replicas[0].gpu_type",
    ),
    ("wrong-gpu-type", _set("machines.0.gpu_type", "H20"), "plan.machines[0].gpu_type"),
    (
        "zero-concurrent-rollouts",
        _set("staleness.max_concurrent_rollouts", 0),
        "plan.staleness.max_concurrent_rollouts",
    ),
    ("negative-eta", _set("staleness.max_head_offpolicyness", -1), "plan.staleness.max_head_offpolicyness"),
    ("nan-share", _set("rollout.replicas.0.share", float("nan")), "plan.rollout.replicas[0].share"),
    (
        "inf-speed",
        _set("rollout.replicas.0.tokens_per_s", float("inf")),
        "plan.rollout.replicas[0].tokens_per_s",
    ),
    ("nan-prediction", _set("predicted.step_time_s", float("nan")), "plan.predicted.step_time_s"),
    ("float-tp", _set("rollout.replicas.0.tp", 1.5), "plan.rollout.replicas[0].tp"),
    ("unknown-role", _set("machines.0.role", "both"), "plan.machines[0].role"),
    ("other-model", _set("model", "Qwen2.5-72B"), "plan.model"),
    ("train-gpus-missing", _set("train.stages.0.dp", 4), "plan.train.stages[0]"),
    # Issue 33: a prediction's interval must hold it.
    ("interval-below", _set("predicted.tokens_per_s_high", 1.0), "plan.predicted.tokens_per_s_high"),
    ("interval-above", _set("predicted.step_time_s_low", 1e8), "plan.predicted.step_time_s_low"),
    ("interval-one-end", _set("predicted.tokens_per_s_low", None), "plan.predicted.tokens_per_s_low"),
    (
        "baseline-interval",
        _set("baselines.homogeneous-H20.tokens_per_s_low", 1e11),
        "plan.baselines.homogeneous-H20.tokens_per_s_low",
    ),
]


def _simulate(tmp_path, capsys, text: str) -> str:
    path = tmp_path / "plan.json"
    path.write_text(text)
    assert main(["simulate", str(RECIPE), "--plan", str(path), "--steps", "1"]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("edit", "field"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_simulate_refuses_a_plan_that_does_not_fit_its_recipe(plan_dict, tmp_path, capsys, edit, field):
    plan = json.loads(json.dumps(plan_dict))
    edit(plan)
    err = _simulate(tmp_path, capsys, json.dumps(plan))
    assert err.startswith(f"error: {field}"), err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("  fix: "), err


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"a":' * 100 + "1" + "}" * 100, "nested more than 32 levels"),
        ('{"schema_version": 1, "x": ' + "9" * 5000 + "}", "not usable JSON"),
        ("\ufeff{}", "not JSON"),
    ],
    ids=["recursion", "deep", "huge-int", "bom"],
)
def test_unusable_plan_files(tmp_path, capsys, text, words):
    err = _simulate(tmp_path, capsys, text)
    assert err.startswith("error: --plan: ") and words in err, err


def test_a_valid_saved_plan_is_accepted(plan_dict, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_dict))
    assert main(["simulate", str(RECIPE), "--plan", str(path), "--steps", "1"]) == 0, capsys.readouterr().err
