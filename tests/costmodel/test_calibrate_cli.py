"""``areal-hex calibrate``: profiles pass through with their sources; bad input exits 2 naming the flag.

The baseline fit itself is checked against the shipped profile in test_paper_targets.py (slow)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.costmodel.calibration import PROFILE_FORMAT, read_profile, read_profile_sources
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.planner.fit_baselines import check_baselines
from areal_hex_plugin.schemas import load_schema
from tests.conftest import REPO


def test_a_profile_alone_passes_through_with_its_sources(tmp_path, capsys):
    profile = tmp_path / "h20.json"
    profile.write_text(
        json.dumps(
            {
                "format": PROFILE_FORMAT,
                "gpu_types": {"H20": {"infer_mfu": 0.5, "train_mfu": 0.3}},
                "sources": {"H20": {"infer_mfu": "SGLang on one H20, 2026-12-01"}},
            }
        )
    )
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--profile", str(profile), "--json", str(out)]) == 0
    written = read_profile(out)["H20"]
    assert written["infer_mfu"] == 0.5 and written["train_mfu"] == 0.3
    sources = read_profile_sources(out)
    assert sources[("H20", "infer_mfu")] == "SGLang on one H20, 2026-12-01"
    assert sources[("H20", "train_mfu")] == "profile h20.json"
    assert sources[("H20", "hbm_fraction")].startswith("assumed default")
    printed = capsys.readouterr().out
    assert "SGLang on one H20" in printed
    written = json.loads(out.read_text())
    jsonschema.validate(written, load_schema("calibrate"))
    # Beside every profile: the rate measured decode kernels stream KV at, against the type's hbm_fraction.
    checks = {c["gpu_type"]: c for c in written["kernel_checks"]}
    assert checks["H20"]["hbm_fraction_source"].startswith("assumed default")
    assert checks["H20"]["ratio"] == round(
        checks["H20"]["kernel_fraction"] / checks["H20"]["hbm_fraction"], 3
    )
    assert "H20        kernels stream KV at 0.75 of HBM" in printed


def test_the_shipped_paper_profile_is_valid():
    shipped = json.loads((REPO / "areal_hex_plugin/costmodel/profiles/paper.json").read_text())
    jsonschema.validate(shipped, load_schema("calibrate"))


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([], "nothing to fit"),
        (["--baselines", "/nonexistent.json"], "cannot read"),
        (["--profile", str(REPO / "recipes/paper/7b.yaml")], "is not JSON"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(tmp_path, capsys, args, words):
    assert main(["calibrate", *args, "--json", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_baselines_are_checked_where_they_enter():
    data = json.loads((REPO / "recipes/paper/baselines.json").read_text())
    assert check_baselines(data) is data
    # A run's tokens per step must be what its tokens/s and phases imply (the paper's metric).
    data["models"]["DeepSeek-R1-Distill-Qwen-7B"]["h20"]["tokens_per_step"] = 2_500_000
    with pytest.raises(HexError, match=r"h20.tokens_per_step 2,500,000 is not tokens_per_s x"):
        check_baselines(data)
    data["models"]["DeepSeek-R1-Distill-Qwen-7B"]["h20"]["tokens_per_step"] = 1_721_000
    data["clusters"]["h20"]["rollout_layout"] = [0, 1]
    with pytest.raises(HexError, match="rollout_layout must be"):
        check_baselines(data)
    with pytest.raises(HexError, match="baselines file"):
        check_baselines({"format": "other"})


@pytest.mark.slow
def test_the_baseline_fit_keeps_a_profiles_factors_whatever_their_source(tmp_path, capsys):
    """Factors a profile gives are kept by the baseline fit, whether the profile states their source or not, and
    where a pair is fitted together the one given holds while the other is fitted (here H20's infer_mfu beside the
    given hbm_fraction); the fit fits the rest (H20's weight update)."""
    profile = tmp_path / "h20.json"
    given = {"hbm_fraction": 0.75, "train_mfu": 0.2}
    stated = "InferSim FlashInfer decode attention on H20"
    profile.write_text(
        json.dumps(
            {
                "format": PROFILE_FORMAT,
                "gpu_types": {"H20": given},
                "sources": {"H20": {"hbm_fraction": stated}},
            }
        )
    )
    out = tmp_path / "cal.json"
    baselines = str(REPO / "recipes" / "paper" / "baselines.json")
    assert main(["calibrate", "--baselines", baselines, "--profile", str(profile), "--json", str(out)]) == 0
    written, sources = read_profile(out)["H20"], read_profile_sources(out)
    assert {k: written[k] for k in given} == given
    assert sources[("H20", "hbm_fraction")] == stated
    assert sources[("H20", "train_mfu")] == "profile h20.json"
    assert sources[("H20", "infer_mfu")].startswith("fit to baselines.json: Table 1 rollout cost ratio")
    assert sources[("H20", "update_gb_per_s")].startswith("fit to baselines.json")
    # With H20's hbm_fraction held, no infer_mfu brings Table 1's flat rollout ratios within 15%: named, not hidden.
    named = {u["measurement"]: u["needs"] for u in json.loads(out.read_text())["unexplained"]}
    table_1 = "Table 1 rollout tokens/s per GPU, h20 over h800, of DeepSeek-R1-Distill-Qwen-"
    assert named[table_1 + "7B"] == named[table_1 + "1.5B"]
    assert named[table_1 + "7B"].startswith("no value of infer_mfu explains it")
    # The check table says how the planner split each measured cluster (its own choice, not the run's).
    printed = capsys.readouterr().out.splitlines()
    for row in json.loads(out.read_text())["check"]:
        split = f"{sum(row['split']['train'].values())} + {sum(row['split']['rollout'].values())}"
        line = next(x for x in printed if x.startswith(f"{row['model']:32}{row['cluster']:8}{row['phase']} "))
        assert line.endswith(f"  {split}"), line


def test_the_kernel_check_covers_only_the_types_written(tmp_path, capsys):
    profile = tmp_path / "h100.json"
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "gpu_types": {"H100": {"infer_mfu": 0.5}}}))
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--profile", str(profile), "--json", str(out)]) == 0
    assert (
        json.loads(out.read_text())["kernel_checks"] == []
    )  # no measured kernels for H100; none for H20 shown
    assert "decode-attention kernels" not in capsys.readouterr().out
