"""``simulate --truth`` (sim/online.py): the machines run on true factors, the planner starts from the recipe's,
and the online refit and re-plan loop closes the gap to the plan the true factors give."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.planner.refit_replan import THRESHOLD
from areal_hex_plugin.schemas import load_schema
from areal_hex_plugin.sim.online import factors_off, read_truth, simulate_truth
from areal_hex_plugin.specs.recipe import Recipe, load_recipe
from tests.conftest import REPO

TINY = REPO / "recipes" / "ci" / "tiny.yaml"
STEPS = 30
GOAL = 0.8


def off_by(recipe, gpu_type: str, change: float):
    """What the machines really do when the recipe believes its calibration: ``gpu_type`` ``change`` off."""
    return factors_off(recipe.calibration, gpu_type, change)


@pytest.fixture(scope="module")
def tiny():
    recipe = load_recipe(TINY, [])
    return recipe, plan_recipe(recipe)


def test_true_factors_as_believed_change_nothing(tiny):
    recipe, plan = tiny
    report = simulate_truth(recipe, plan, recipe.calibration, STEPS)
    assert len(report.plans) == 1 and report.refits
    assert [s.tokens for s in report.steps] == [s.tokens for s in report.believed]
    assert report.recovered is None and report.converged_step == report.refits[0]["step"]


def test_a_type_worse_than_believed_is_refit_and_the_gap_recovered(tiny):
    recipe, plan = tiny
    report = simulate_truth(recipe, plan, off_by(recipe, "CPU-SMALL", -0.3), STEPS)
    assert report.gap > THRESHOLD
    assert report.recovered >= GOAL
    assert len(report.plans) == 2 and report.converged_step <= 10
    assert max(r["cpu_s"] for r in report.refits) < 1.0
    first = report.refits[0]
    assert first["factors"]["CPU-SMALL"]["hbm_fraction"] == pytest.approx(0.8 * 0.7, rel=0.05)
    assert any("re-plan" in n for notes in report.notes for n in notes)


def test_a_type_better_than_believed_is_refit_and_the_gap_recovered(tiny):
    """Until the planner priced a draining window's first batch from empty (``inflight.first_batch_s``) the loop
    re-planned here to a plan it predicted 16% faster that ran 6% slower than the believed one."""
    recipe, plan = tiny
    report = simulate_truth(recipe, plan, off_by(recipe, "CPU-BIG", 0.3), STEPS)
    assert report.gap > THRESHOLD
    assert report.recovered >= GOAL
    assert len(report.plans) == 2


@functools.cache
def _paper(name: str) -> tuple[Recipe, HexPlan]:
    """A paper recipe and the plan its factors give, made once for both of its cases below."""
    recipe = load_recipe(REPO / "recipes" / "paper" / f"{name}.yaml", [])
    return recipe, plan_recipe(recipe)


@pytest.mark.slow
@pytest.mark.parametrize(  # each recipe with each type once, one better and one worse than believed (CI time)
    ("name", "gpu_type", "change"),
    [
        ("1.5b", "H800-PCIe", 0.3),  # only the runtime settings change (window, caps, admission)
        ("1.5b", "H20", -0.3),  # the same, a gain of 4.9% under the refit model
        ("7b", "H800-PCIe", -0.3),
        ("7b", "H20", 0.3),
        ("14b", "H800-PCIe", 0.3),  # the H20 fit must stay on its prior (one running count measured)
        ("14b", "H20", -0.3),
    ],
)
def test_the_paper_recipes_recover_the_gap_within_30_steps(name, gpu_type, change):
    # Where the believed plan is within the re-plan threshold of the true-factor plan there is nothing the loop
    # is meant to recover, and it must not flap: no re-plan.
    recipe, plan = _paper(name)
    report = simulate_truth(recipe, plan, off_by(recipe, gpu_type, change), STEPS)
    if report.gap <= THRESHOLD:
        assert len(report.plans) == 1
    else:
        assert report.recovered >= GOAL
    assert max(r["cpu_s"] for r in report.refits) < 1.0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe_file", "gpu_type", "change"),
    [("h100_a100_llama3.1-8b.yaml", "H100", -0.5), ("h100_rtx4090_qwen3-4b.yaml", "RTX4090", -0.3)],
)
def test_a_mix_with_a_gap_recovers_it(recipe_file, gpu_type, change):
    recipe = load_recipe(REPO / "recipes" / "mixes" / recipe_file, [])
    report = simulate_truth(recipe, plan_recipe(recipe), off_by(recipe, gpu_type, change), STEPS)
    assert report.gap > THRESHOLD and report.recovered >= GOAL


def _truth_file(tmp_path, factors: dict) -> str:
    path = tmp_path / "truth.json"
    path.write_text(json.dumps({"format": "areal-hex-profile/1", "gpu_types": {"CPU-SMALL": factors}}))
    return str(path)


def test_simulate_truth_writes_the_table_and_json(tmp_path, capsys):
    truth = _truth_file(tmp_path, {"hbm_fraction": 0.56, "update_fixed_s": 2.14})
    out = tmp_path / "sim.json"
    argv = [
        "simulate",
        str(TINY),
        "--truth",
        truth,
        "--steps",
        "10",
        "--refit-every",
        "5",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "true-factor plan" in text and "refit (" in text
    data = json.loads(out.read_text())
    jsonschema.validate(data, load_schema("simulate"), cls=jsonschema.Draft202012Validator)
    assert data["truth"]["file"] == truth and len(data["truth"]["per_step"]) == 10


@pytest.mark.parametrize(
    ("extra", "factors", "field"),
    [
        ([], {"hbm_fraction": 5.0}, "--truth[CPU-SMALL].hbm_fraction"),
        ([], {"hbm_fraction": float("nan")}, "--truth[CPU-SMALL].hbm_fraction"),
        ([], {"bogus": 1.0}, "--truth[CPU-SMALL].bogus"),
        (["--faults", "recipes/faults/lost_machines.yml"], {}, "--truth"),
        (["--refit-every", "0"], {}, "--refit-every"),
    ],
)
def test_a_bad_truth_exits_2_with_one_message(extra, factors, field, tmp_path, capsys):
    truth = _truth_file(tmp_path, factors)
    assert main(["simulate", str(TINY), "--truth", truth, "--steps", "5", *extra]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err


def test_refit_every_needs_truth(capsys):
    assert main(["simulate", str(TINY), "--refit-every", "5"]) == 2
    assert "--refit-every" in capsys.readouterr().err


def test_a_truth_profile_s_catalog_figures_are_the_machines(tmp_path):
    """Issue 34's 3x case replayed: the recipe declares CPU-BIG's memory bandwidth 3x too low, the truth's
    ``gpu_catalog`` gives the right figure. The machines run at the true figure, the refit recovers it and the
    loop the gap to the plan made with it."""
    true_tb_per_s = load_recipe(TINY, []).catalog.get("CPU-BIG", "test").hbm_tb_per_s
    recipe = load_recipe(TINY, [f"hex.gpu_catalog.CPU-BIG.hbm_tb_per_s={true_tb_per_s / 3}"])
    path = tmp_path / "truth.json"
    path.write_text(
        json.dumps(
            {
                "format": "areal-hex-profile/1",
                "gpu_types": {"CPU-BIG": {}},
                "gpu_catalog": {"CPU-BIG": {"hbm_tb_per_s": true_tb_per_s}},
            }
        )
    )
    truth = read_truth(str(path), recipe)
    assert truth.figure("CPU-BIG", "hbm_tb_per_s") == pytest.approx(true_tb_per_s)
    report = simulate_truth(recipe, plan_recipe(recipe), truth, STEPS)
    assert report.gap > THRESHOLD and report.recovered >= GOAL, (report.gap, report.recovered)


def test_a_bad_truth_catalog_figure_exits_2_naming_it(tmp_path, capsys):
    path = tmp_path / "truth.json"
    path.write_text(
        json.dumps(
            {
                "format": "areal-hex-profile/1",
                "gpu_types": {"CPU-BIG": {}},
                "gpu_catalog": {"CPU-BIG": {"hbm_tb_per_s": -1}},
            }
        )
    )
    assert main(["simulate", str(TINY), "--truth", str(path), "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "--truth" in err and "hbm_tb_per_s" in err and "Traceback" not in err
