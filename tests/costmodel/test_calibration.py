"""Calibration sources: built-in defaults, a profile JSON and a recipe's ``hex.calibration``."""

from __future__ import annotations

import json

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.costmodel import Calibration, CostModel, RolloutStage
from areal_hex_plugin.costmodel.calibration import GENERIC, PROFILE_FORMAT, read_profile
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.planner import plan_recipe
from tests.conftest import REPO
from tests.costmodel.helpers import recipe

TINY = REPO / "recipes" / "ci" / "tiny.yaml"


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("++hex.calibration.gpu_types.H20.infer_mfu=1.5", "must be a number in (0, 1]"),
        ("++hex.calibration.gpu_types.Z9000.infer_mfu=0.5", "unknown GPU type 'Z9000'"),
        ("++hex.calibration.profile=/nonexistent/p.json", "cannot read"),
    ],
)
def test_bad_calibration_in_a_recipe_names_the_field(override, words):
    with pytest.raises(HexError, match="hex.calibration") as err:
        recipe("paper/7b.yaml", override)
    assert words in str(err.value)


def test_unknown_factor_key_is_refused_by_the_schema():
    with pytest.raises(HexError, match="unknown key"):
        recipe("paper/7b.yaml", "++hex.calibration.gpu_types.H20.mfu=0.5")


def test_profile_file_checks(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"format": "areal-hex-profile/1", "gpu_types": {"H20": {"hbm_fraction": 0}}}))
    with pytest.raises(HexError, match=r"\[H20\]\.hbm_fraction: must lie in its physical range 0.4 to 0.9"):
        read_profile(bad)
    bad.write_text(json.dumps({"format": "areal-hex-profile/1", "gpu_types": {}}))
    with pytest.raises(HexError, match="lists no gpu_types"):
        read_profile(bad)
    bad.write_text(json.dumps({"format": "areal-hex-plan/1", "gpu_types": {"H20": {"infer_mfu": 0.5}}}))
    with pytest.raises(
        HexError, match=r"p.json is not an areal-hex profile \(format 'areal-hex-profile/1'\)"
    ):
        read_profile(bad)


def test_unlisted_types_take_the_generic_defaults():
    assert Calibration().for_gpu("B200") == GENERIC
    assert Calibration().with_factors("B200", {"train_mfu": 0.5}).for_gpu("B200").train_mfu == 0.5


def _with_catalog(tmp_path, section) -> str:
    path = tmp_path / "refit.json"
    factors = {"CPU-BIG": {"hbm_fraction": 0.8}}
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "gpu_types": factors, "gpu_catalog": section}))
    return str(path)


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"CPU-BIG": {"hbm_tb_per_s": float("nan")}}, "gpu_catalog.CPU-BIG.hbm_tb_per_s"),
        ({"CPU-BIG": {"hbm_tb_per_s": 5000}}, "gpu_catalog.CPU-BIG.hbm_tb_per_s"),
        ({"CPU-BIG": {"hbm_tb_per_s": -1}}, "gpu_catalog.CPU-BIG.hbm_tb_per_s"),
        ({"CPU-BIG": {"hbm_gbs": 1}}, "gpu_catalog.CPU-BIG.hbm_gbs: unknown key"),
        ({"CPU-BIG": 3}, "gpu_catalog.CPU-BIG: must be a mapping"),
        ([1], "gpu_catalog: must map GPU types to their figures"),
        ({"Z9000": {"hbm_tb_per_s": 1}}, "gpu_catalog.Z9000: unknown GPU type 'Z9000'"),
    ],
    ids=["nan", "out-of-range", "negative", "unknown-figure", "not-a-mapping", "not-types", "unknown-type"],
)
def test_a_profiles_catalog_figures_are_checked_and_plan_exits_2_with_one_message(
    tmp_path, capsys, section, words
):
    profile = _with_catalog(tmp_path, section)
    assert main(["plan", str(TINY), f"hex.calibration.profile={profile}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hex.calibration.profile") and words in err, err
    assert "Traceback" not in err and err.count("error:") == 1


def test_a_profiles_catalog_figure_replaces_the_recipes_in_every_model_and_plan(tmp_path):
    """A refit figure (``gpu_catalog``) takes the place of the recipe's ``hex.gpu_catalog`` figure: in the
    recipe's calibration with its source, in a cost model built on it, and in the plan."""
    true = recipe("ci/tiny.yaml").catalog.get("CPU-BIG", "t").hbm_tb_per_s  # the recipe's own figure
    low = true / 5
    declared = recipe("ci/tiny.yaml", f"hex.gpu_catalog.CPU-BIG.hbm_tb_per_s={low}")
    profile = _with_catalog(tmp_path, {"CPU-BIG": {"hbm_tb_per_s": true}})
    refit = recipe(
        "ci/tiny.yaml", f"hex.gpu_catalog.CPU-BIG.hbm_tb_per_s={low}", f"hex.calibration.profile={profile}"
    )
    assert refit.calibration.figure("CPU-BIG", "hbm_tb_per_s") == true
    assert refit.calibration.source("CPU-BIG", "hbm_tb_per_s") == "profile refit.json"
    cm = CostModel(refit.cluster, refit.workload, refit.calibration)
    assert cm.cluster.pool("big").gpu.hbm_tb_per_s == true
    assert cm.catalog_cluster.pool("big").gpu.hbm_tb_per_s == low
    stages = (RolloutStage("big", 1),)
    assert (
        cm.rollout(stages).step_time_s
        < CostModel(declared.cluster, declared.workload).rollout(stages).step_time_s
    )
    assert cm.with_calibration(Calibration()).cluster.pool("big").gpu.hbm_tb_per_s == low
    plan = plan_recipe(refit)
    shares = {g.pool: g.share for g in plan.rollout.replicas}
    assert shares == {g.pool: g.share for g in plan_recipe(recipe("ci/tiny.yaml")).rollout.replicas}
    # The plan says which figure it used in place of the recipe's, and where it came from.
    said = f"CPU-BIG hbm_tb_per_s {true:.4g} (in place of hex.gpu_catalog's) from profile refit.json"
    assert said in plan.predicted.sources["rollout"] and said in plan.predicted.sources["train"]
    assert "hbm_tb_per_s" not in plan_recipe(declared).predicted.sources["rollout"]
