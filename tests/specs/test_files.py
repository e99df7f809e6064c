"""Reading a JSON file of one of our formats: every way it can be something else is one error naming the field."""

from __future__ import annotations

import json

import pytest

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.files import read_format

FIX = "give a file written by areal-hex profile"


@pytest.mark.parametrize(
    "text",
    ['{"format": "areal-hex-plan/1", "x": 1}', "[1, 2]", '{"x": 1}', '"areal-hex-profile/1"'],
    ids=["other-format", "a-list", "no-format", "a-string"],
)
def test_anything_but_an_object_of_the_format_is_refused_naming_the_field_file_and_format(tmp_path, text):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(HexError) as err:
        read_format(path, "areal-hex-profile/1", "hex.calibration.profile", "an areal-hex profile", FIX)
    assert err.value.field == "hex.calibration.profile"
    assert f"{path} is not an areal-hex profile (format 'areal-hex-profile/1')" in str(err.value)
    assert FIX in str(err.value)


def test_a_field_that_is_the_files_name_does_not_repeat_it(tmp_path):
    path = tmp_path / "table.json"
    path.write_text("{}")
    with pytest.raises(HexError) as err:
        read_format(path, "t/1", str(path), "a table", FIX)
    assert str(err.value).count(str(path)) == 1


def test_an_object_of_the_format_is_returned_whole(tmp_path):
    path = tmp_path / "p.json"
    data = {"format": "areal-hex-profile/1", "gpu_types": {"H20": {"infer_mfu": 0.5}}}
    path.write_text(json.dumps(data))
    assert read_format(path, "areal-hex-profile/1", "f", "a profile", FIX) == data
