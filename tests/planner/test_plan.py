"""The HexPlan contract: JSON round trip, versioning and strict reading of malformed files."""

from __future__ import annotations

import json

import pytest

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.plan import (
    SCHEMA_VERSION,
    Baseline,
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


def small_plan() -> HexPlan:
    train_gpus = [
        GpuAssignment(gpu=i, role="train", stage=0, dp_rank=i // 2, tp_rank=i % 2) for i in range(4)
    ]
    rollout_gpus = [
        GpuAssignment(gpu=i, role="rollout", group=0, instance=i, stage=0, tp_rank=0) for i in range(4)
    ]
    return HexPlan(
        recipe="r.yaml",
        model="m",
        objective=Objective(kind="budget", budget_per_hour=10.0),
        predicted=Predicted(1000.0, 9.0, 400000.0, 10.0, 8.0, 9.5, 0.5),
        train=TrainPlan(gpus={"H800": 4}, stages=[TrainStage("a", "H800", 2, 2, 28, ["a-0"])]),
        rollout=RolloutPlan(
            gpus={"H20": 4}, replicas=[ReplicaGroup("b", "H20", 1, 1, 4, 1.0, 64, 250.0, 32)]
        ),
        machines=[
            Machine("a", "a-0", "H800", "train", train_gpus),
            Machine("b", "b-0", "H20", "rollout", rollout_gpus),
            Machine("b", "b-1", "H20", "idle", [GpuAssignment(gpu=i, role="idle") for i in range(4)]),
        ],
        baselines={"uniform": Baseline(900.0, 9.0, {"H800": 4, "H20": 4})},
        solver=SolverInfo(0.1, "optimal", 3, 0.0),
        staleness=Staleness(4, 128),
        runtime="fsdp + sglang",
    )


def test_round_trip_through_json_file(tmp_path):
    plan = small_plan()
    path = plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert list(data)[0] == "schema_version"
    assert data["machines"][0]["gpus"][3] == {
        "gpu": 3, "role": "train", "stage": 0, "dp_rank": 1, "tp_rank": 1, "group": None, "instance": None
    }  # fmt: skip
    loaded = HexPlan.load(path)
    assert loaded == plan
    assert [m.host for m in loaded.machines_with_role("idle")] == ["b-1"]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(schema_version=0), "plan.schema_version"),
        (lambda d: d.pop("schema_version"), "plan.schema_version"),
        (lambda d: d["predicted"].pop("tokens_per_s"), "plan.predicted.tokens_per_s"),
        (lambda d: d["predicted"].update(tokens_per_s="fast"), "plan.predicted.tokens_per_s"),
        (lambda d: d["train"]["stages"][0].update(dp=2.5), "plan.train.stages[0].dp"),
        (lambda d: d.update(surprise=1), "plan.surprise"),
        (lambda d: d["machines"][0].update(role="boss"), "plan.machines[0].role"),
        (lambda d: d["machines"][1]["gpus"][0].update(group=7), "plan.machines[1].gpus[0].group"),
        (lambda d: d["machines"][0]["gpus"][0].update(stage=None), "plan.machines[0].gpus[0].stage"),
        (lambda d: d["rollout"]["replicas"][0].update(count=0), "plan.rollout.replicas[0].count"),
        (lambda d: d["rollout"]["replicas"][0].update(concurrency=0), "plan.rollout.replicas[0].concurrency"),
        (lambda d: d["rollout"]["replicas"][0].update(share=-0.5), "plan.rollout.replicas[0].share"),
        (lambda d: d["train"]["stages"][0].update(dp=0), "plan.train.stages[0].dp"),
        (lambda d: d["predicted"].update(tokens_per_s=0), "plan.predicted.tokens_per_s"),
        (lambda d: d["rollout"]["replicas"][0].update(share=0.5), "plan.rollout.replicas"),
        (lambda d: d["rollout"]["replicas"][0].update(share=0), "plan.rollout.replicas"),
        (lambda d: d.update(runtime=""), "plan.runtime"),
        (lambda d: d.pop("runtime"), "plan.runtime"),
    ],
)
def test_malformed_plans_name_the_field(tmp_path, edit, field):
    data = small_plan().to_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HexError) as err:
        HexPlan.load(path)
    assert err.value.field == field


def test_unreadable_files_are_hex_errors(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    for path in (tmp_path / "x.json", tmp_path / "missing.json"):
        with pytest.raises(HexError) as err:
            HexPlan.load(path)
        assert err.value.field == "plan"
    with pytest.raises(HexError):
        HexPlan.from_dict([1, 2])


def _with_interval(plan: HexPlan, low: float, high: float) -> HexPlan:
    import dataclasses

    p = plan.predicted
    step = p.step_time_s
    interval = dict(
        tokens_per_s_low=low,
        tokens_per_s_high=high,
        step_time_s_low=step * p.tokens_per_s / high,
        step_time_s_high=step * p.tokens_per_s / low,
    )
    return dataclasses.replace(plan, predicted=dataclasses.replace(p, **interval))


def test_a_plan_saved_before_intervals_loads_without_one_and_one_with_round_trips(tmp_path):
    old = small_plan()
    assert HexPlan.load(old.save(tmp_path / "old.json")).predicted.tokens_per_s_low is None
    plan = _with_interval(old, 900.0, 1100.0)
    assert HexPlan.load(plan.save(tmp_path / "new.json")) == plan


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda p: p.update(tokens_per_s=1200.0), "plan.predicted.tokens_per_s_high"),
        (lambda p: p.update(tokens_per_s=800.0), "plan.predicted.tokens_per_s_low"),
        (lambda p: p.update(tokens_per_s_low=None), "plan.predicted.tokens_per_s_low"),
        (lambda p: p.update(tokens_per_s_high=None), "plan.predicted.tokens_per_s_high"),
        (lambda p: p.update(step_time_s=p["step_time_s_high"] * 2), "plan.predicted.step_time_s_high"),
        (lambda p: p.update(train_logp_s=p["train_time_s"] * 1.5), "plan.predicted.train_logp_s"),
    ],
)
def test_an_interval_that_does_not_hold_its_prediction_is_refused(edit, field):
    data = _with_interval(small_plan(), 900.0, 1100.0).to_dict()
    edit(data["predicted"])
    with pytest.raises(HexError) as err:
        HexPlan.from_dict(data)
    assert err.value.field == field


def test_a_step_interval_may_be_open_above():
    """A factor's range end at which the plan cannot run leaves the step unbounded: its high end is null."""
    data = _with_interval(small_plan(), 900.0, 1100.0).to_dict()
    data["predicted"]["step_time_s_high"] = None
    assert HexPlan.from_dict(data).predicted.step_time_s_high is None
