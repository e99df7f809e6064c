"""Every JSON output is versioned and valid against the JSON Schema the package ships for it (``reproduce``'s is
checked where the README's example runs it, in test_documented_examples.py)."""

from __future__ import annotations

import json
import tomllib

import jsonschema
import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.planner.explain import describe_binding, describe_role
from areal_hex_plugin.schemas import NAMES, load_schema, plan_schema
from tests.conftest import REPO

PAPER_7B = str(REPO / "recipes/paper/7b.yaml")
MIX = str(REPO / "recipes/mixes/h100_rtx4090_qwen3-4b.yaml")


def _valid(document: dict, name: str) -> None:
    jsonschema.validate(document, load_schema(name), cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("name", NAMES)
def test_each_schema_is_a_valid_json_schema_shipped_as_package_data(name):
    jsonschema.Draft202012Validator.check_schema(load_schema(name))
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "schemas/*.schema.json" in package_data["areal_hex_plugin"]


def test_the_shipped_plan_schema_is_the_one_the_dataclasses_give():
    assert load_schema("plan") == plan_schema(), "run: python -m areal_hex_plugin.schemas"


def _run(args: list[str], capsys) -> dict:
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_is_valid_and_has_its_reasons_as_fields(capsys):
    plan = _run(["plan", PAPER_7B, "--json", "-"], capsys)
    _valid(plan, "plan")
    binding = plan["binding_constraint"]
    assert binding["limits"][0] == binding["slower"]
    assert binding["budget_left_per_hour"] == pytest.approx(
        plan["objective"]["budget_per_hour"] - plan["predicted"]["cost_per_hour"]
    )
    for pool, role in plan["pool_role_reasons"].items():
        machines = [m["role"] for m in plan["machines"] if m["pool"] == pool]
        assert [role[r] for r in ("train", "rollout", "idle")] == [
            machines.count(r) for r in ("train", "rollout", "idle")
        ]
    # The sentences are the fields, in words.
    from areal_hex_plugin.plan import HexPlan

    loaded = HexPlan.from_dict(plan)
    assert describe_binding(loaded.binding_constraint, loaded.objective) == loaded.binding
    assert {p: describe_role(r) for p, r in loaded.pool_role_reasons.items()} == loaded.pool_roles
    extra = dict(plan, surprise=1)
    with pytest.raises(jsonschema.ValidationError):  # the schema changes when the format does
        _valid(extra, "plan")


def test_estimate_and_simulate_json_are_versioned_and_valid(tmp_path, capsys):
    estimate = _run(["estimate", MIX, "++hex.workload.model=Qwen2.5-32B", "--json", "-"], capsys)
    assert estimate["schema_version"] == 1
    _valid(estimate, "estimate")  # with an infeasible training layout in it
    simulated = _run(["simulate", MIX, "--steps", "3", "--json", "-"], capsys)
    assert simulated["schema_version"] == 1
    _valid(simulated, "simulate")
    trace = _run(["simulate", MIX, "--steps", "3", "--trace", "-"], capsys)
    assert trace["otherData"]["schema_version"] == 1
    _valid(trace, "trace")


def test_a_profile_is_valid(tmp_path, monkeypatch, capsys):
    from tests.costmodel.helpers import TRUTH, recipe, synthetic_measurements

    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(synthetic_measurements(recipe("paper/7b.yaml"), "H20", TRUTH)))
    args = ["profile", PAPER_7B, "--gpu-type", "H20", "--from-measurements", str(raw), "--json", "-"]
    profile = _run(args, capsys)
    assert profile["format"] == "areal-hex-profile/1"
    _valid(profile, "profile")
