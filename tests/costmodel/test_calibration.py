"""Calibration sources (defaults, profile JSON, recipe) and the profile command's CPU-side paths."""

from __future__ import annotations

import json

import pytest

from areal_hex_plugin.areal.profiler import measure
from areal_hex_plugin.cli import main
from areal_hex_plugin.commands.profile import MEASUREMENTS_FORMAT, derive_factors
from areal_hex_plugin.costmodel import Calibration, CostModel, RolloutStage, recipe_calibration
from areal_hex_plugin.costmodel.calibration import DEFAULTS, GENERIC, read_profile
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.models import ModelShape
from tests.conftest import REPO
from tests.costmodel.helpers import recipe

PAPER_7B = REPO / "recipes/paper/7b.yaml"


def _measurements(dense_s: float = 0.01) -> dict:
    return {
        "format": MEASUREMENTS_FORMAT,
        "device_name": "NVIDIA H20",
        "decode": [
            {"batch": 1, "dense_s": 0.004, "dense_flops": 1.5e10, "weight_bytes": 1.5e10, "attention_s": 1e-3,
             "kv_bytes": 3.0e9},
            {"batch": 256, "dense_s": dense_s, "dense_flops": 3.9e12, "weight_bytes": 1.5e10, "attention_s": 0.2,
             "kv_bytes": 6.0e11},
        ],
        "train": {"tokens": 8192, "step_s": 5.0, "model_flops": 2.0e14},
    }  # fmt: skip


def test_derive_factors_from_measurements():
    factors = derive_factors(_measurements(), hbm_tb_per_s=4.0, tflops_bf16=148.0)
    assert factors == {
        "hbm_fraction": pytest.approx(3.75e12 / 4e12),  # 15 GB of weights in 4 ms beats 600 GB of KV in 0.2 s
        "infer_mfu": 1.0,  # 390 TFLOPS measured on a 148 TFLOPS part: capped
        "train_mfu": pytest.approx(4e13 / 148e12, rel=1e-3),
    }
    assert derive_factors(_measurements(dense_s=0.05), 4.0, 148.0)["infer_mfu"] == pytest.approx(
        3.9e12 / 0.05 / 148e12, rel=1e-3
    )


def test_derive_factors_rejects_incomplete_measurements():
    broken = _measurements()
    del broken["train"]
    with pytest.raises(HexError, match="incomplete or malformed"):
        derive_factors(broken, 4.0, 148.0)


def test_profile_command_from_measurements_writes_a_profile_recipes_can_use(tmp_path, capsys):
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(_measurements(dense_s=0.05)))
    out = tmp_path / "h20.json"
    assert (
        main(["profile", "--gpu-type", "h20-96gb", "--from-measurements", str(raw), "--json", str(out)]) == 0
    )
    assert "infer_mfu" in capsys.readouterr().out
    factors = read_profile(out)["H20"]
    assert factors["infer_mfu"] == pytest.approx(0.527, abs=1e-3)
    # A recipe pointing at it gets those factors; its own hex.calibration entries win over the profile.
    r = recipe(
        "paper/7b.yaml", f"++hex.calibration.profile={out}", "++hex.calibration.gpu_types.H20.train_mfu=0.3"
    )
    cal = recipe_calibration(r)
    assert cal.for_gpu("H20").infer_mfu == pytest.approx(0.527, abs=1e-3)
    assert cal.for_gpu("H20").train_mfu == 0.3
    assert cal.for_gpu("H800-PCIe") == DEFAULTS["H800-PCIe"]
    # ... and the model answers differently with them.
    slow = CostModel(r.cluster, r.workload, cal).rollout((RolloutStage("h20", 1),))
    default = CostModel(r.cluster, r.workload).rollout((RolloutStage("h20", 1),))
    assert slow.tokens_per_s < default.tokens_per_s
    # A saved profile also works as --from-measurements input.
    again = tmp_path / "again.json"
    assert main(["profile", "--gpu-type", "H20", "--from-measurements", str(out), "--json", str(again)]) == 0


@pytest.mark.parametrize(
    ("content", "words"),
    [("{", "not JSON"), ('{"format": "other"}', "holds no measurements"), ("[1]", "holds no measurements")],
)
def test_profile_command_bad_measurements_exit_2_without_output(tmp_path, capsys, content, words):
    raw = tmp_path / "raw.json"
    raw.write_text(content)
    out = tmp_path / "out.json"
    assert main(["profile", "--gpu-type", "H20", "--from-measurements", str(raw), "--json", str(out)]) == 2
    assert words in capsys.readouterr().err and not out.exists()


def test_profile_command_without_a_gpu_says_so(tmp_path, capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["profile", "--gpu-type", "H20", "--json", str(tmp_path / "p.json")]) == 2
    assert "no CUDA GPU on this machine" in capsys.readouterr().err


def test_unknown_gpu_type_is_refused(tmp_path, capsys):
    assert main(["profile", "--gpu-type", "Z9000", "--json", str(tmp_path / "p.json")]) == 2
    assert "unknown GPU type 'Z9000'" in capsys.readouterr().err


def test_measure_runs_its_kernels_on_cpu():
    pytest.importorskip("torch")
    tiny = ModelShape("tiny", 2, 64, 4, 2, 128, 256, False)
    raw = measure(tiny, (1, 4), context=32, train_tokens=128, device="cpu", copy_mib=2)
    assert raw["format"] == MEASUREMENTS_FORMAT and [d["batch"] for d in raw["decode"]] == [1, 4]
    assert raw["decode"][1]["dense_flops"] == 4 * raw["decode"][0]["dense_flops"]
    factors = derive_factors(raw, hbm_tb_per_s=4.0, tflops_bf16=148.0)
    assert set(factors) == {"hbm_fraction", "infer_mfu", "train_mfu"}
    assert all(0 < v <= 1 for v in factors.values())


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("++hex.calibration.gpu_types.H20.infer_mfu=1.5", "must be a fraction in (0, 1]"),
        ("++hex.calibration.gpu_types.Z9000.infer_mfu=0.5", "unknown GPU type 'Z9000'"),
        ("++hex.calibration.profile=/nonexistent/p.json", "cannot read"),
    ],
)
def test_bad_calibration_in_a_recipe_names_the_field(override, words):
    with pytest.raises(HexError, match="hex.calibration") as err:
        recipe_calibration(recipe("paper/7b.yaml", override))
    assert words in str(err.value)


def test_unknown_factor_key_is_refused_by_the_schema():
    with pytest.raises(HexError, match="unknown key"):
        recipe("paper/7b.yaml", "++hex.calibration.gpu_types.H20.mfu=0.5")


def test_profile_file_checks(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"format": "areal-hex-profile/1", "gpu_types": {"H20": {"hbm_fraction": 0}}}))
    with pytest.raises(HexError, match=r"\[H20\]\.hbm_fraction: must be a fraction"):
        read_profile(bad)
    bad.write_text(json.dumps({"format": "areal-hex-profile/1", "gpu_types": {}}))
    with pytest.raises(HexError, match="lists no gpu_types"):
        read_profile(bad)


def test_unlisted_types_take_the_generic_defaults():
    assert Calibration().for_gpu("B200") == GENERIC
    assert Calibration().with_factors("B200", {"train_mfu": 0.5}).for_gpu("B200").train_mfu == 0.5
