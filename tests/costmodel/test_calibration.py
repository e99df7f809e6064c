"""Calibration sources: built-in defaults, a profile JSON and a recipe's ``hex.calibration``."""

from __future__ import annotations

import json

import pytest

from areal_hex_plugin.costmodel import Calibration
from areal_hex_plugin.costmodel.calibration import GENERIC, read_profile
from areal_hex_plugin.errors import HexError
from tests.costmodel.helpers import recipe


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


def test_unlisted_types_take_the_generic_defaults():
    assert Calibration().for_gpu("B200") == GENERIC
    assert Calibration().with_factors("B200", {"train_mfu": 0.5}).for_gpu("B200").train_mfu == 0.5
