"""Issue 16: ``areal-hex profile --from-measurements`` refuses NaN, inf, huge and non-numeric fields where the file
enters (exit 2, the field and the fix), and never writes a profile with a NaN in it."""

from __future__ import annotations

import json
import math

import pytest

from areal_hex_plugin.cli import main
from tests.conftest import REPO
from tests.costmodel.helpers import TRUTH, recipe, synthetic_measurements

INF = float("inf")
NAN = float("nan")


def _point(key, value):
    return lambda m: m["decode"]["points"][0].update({key: value})


def _train(key, value):
    return lambda m: m["train"].update({key: value})


CASES = [
    ("step-nan", _point("step_s", NAN), "measurements.decode.points[0].step_s"),
    ("prefill-inf", _point("prefill_s", INF), "measurements.decode.points[0].prefill_s"),
    ("batch-huge", _point("batch", 10**15), "measurements.decode.points[0].batch"),
    ("batch-text", _point("batch", "eight"), "measurements.decode.points[0].batch"),
    ("batch-float", _point("batch", 8.5), "measurements.decode.points[0].batch"),
    ("tp-huge", lambda m: m["decode"].update(tp=10**9), "measurements.decode.tp"),
    ("prompt-nan", lambda m: m["decode"].update(prompt_tokens=NAN), "measurements.decode.prompt_tokens"),
    ("sequences-1e300", _train("sequences", 1e300), "measurements.train.sequences"),
    ("sequences-huge-int", _train("sequences", 10**300), "measurements.train.sequences"),
    ("gpus-nan", _train("gpus", NAN), "measurements.train.gpus"),
    ("logp-inf", _train("logp_s", INF), "measurements.train.logp_s"),
    ("bus-nan", _train("allreduce_bus_gb_per_s", NAN), "measurements.train.allreduce_bus_gb_per_s"),
    ("minibatches-text", _train("minibatches", "4"), "measurements.train.minibatches"),
    ("points-not-a-list", lambda m: m["decode"].update(points={"batch": 1}), "measurements.decode.points"),
    ("unknown-key", _train("stepp_s", 1.0), "measurements.train.stepp_s"),
]


def _run(tmp_path, capsys, text: str) -> tuple[int, str]:
    raw = tmp_path / "raw.json"
    raw.write_text(text)
    out = tmp_path / "h20.json"
    code = main(["profile", str(REPO / "recipes/paper/7b.yaml"), "--gpu-type", "H20", "--json", str(out),
                 "--from-measurements", str(raw)])  # fmt: skip
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("damage", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_measurement_exits_2_naming_the_field(tmp_path, capsys, damage, field):
    measured = synthetic_measurements(recipe("paper/7b.yaml"), "H20", TRUTH)
    damage(measured)
    code, err = _run(tmp_path, capsys, json.dumps(measured))
    assert code == 2 and err.startswith(f"error: {field}"), err
    assert "fix:" in err and not (tmp_path / "h20.json").exists()


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, '{"format": ' + "1" * 5000 + "}", '{"x": 1e400}'],
    ids=["deep", "long-int", "1e400"],
)
def test_unusable_measurement_files_exit_2(tmp_path, capsys, text):
    code, err = _run(tmp_path, capsys, text)
    assert code == 2 and err.startswith("error: --from-measurements"), err


def test_a_valid_file_gives_a_finite_profile(tmp_path, capsys):
    code, err = _run(
        tmp_path, capsys, json.dumps(synthetic_measurements(recipe("paper/7b.yaml"), "H20", TRUTH))
    )
    assert code == 0, err
    fit = json.loads((tmp_path / "h20.json").read_text())["fit"]["H20"]
    assert math.isfinite(fit["rms_log_error"])


def test_a_profile_nested_too_deeply_names_the_recipe_field(tmp_path):
    from areal_hex_plugin.errors import HexError

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(HexError) as err:
        recipe("paper/7b.yaml", f"++hex.calibration.profile={deep}")
    assert err.value.field == "hex.calibration.profile"
