"""Fitting efficiency factors to measurements, and ``areal-hex profile``'s CPU-side paths.

Measurements here are written by the cost model itself with known factors (optionally with noise), so the fit
must hand those factors back: that checks the inverse against the forward model, with nothing hard-coded.
"""

from __future__ import annotations

import json

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.costmodel import CostModel, RolloutStage
from areal_hex_plugin.costmodel.calibration import GENERIC, RANGES, read_profile
from areal_hex_plugin.costmodel.fit import fit_profile
from areal_hex_plugin.errors import HexError
from tests.costmodel.helpers import TRUTH, pool_of, recipe, synthetic_measurements


@pytest.mark.parametrize(
    ("name", "gpu_type", "tp"),
    [("paper/7b.yaml", "H20", 1), ("paper/7b.yaml", "H800-PCIe", 1), ("paper/14b.yaml", "H20", 2),
     ("paper/1.5b.yaml", "H800-PCIe", 1)],
)  # fmt: skip
def test_fit_recovers_the_factors_that_produced_the_measurements(name, gpu_type, tp):
    r = recipe(name)
    fit = fit_profile(
        pool_of(r, gpu_type), r.workload.model, synthetic_measurements(r, gpu_type, TRUTH, tp=tp)
    )
    assert fit.factors == pytest.approx(TRUTH, rel=0.01)
    assert fit.rms_log_error < 0.01
    assert [p["what"] for p in fit.points] == ["prefill", "decode_step"] * 4 + ["train_step"]


def test_fit_tolerates_noisy_measurements():
    r = recipe("paper/7b.yaml")
    fit = fit_profile(
        pool_of(r, "H20"), r.workload.model, synthetic_measurements(r, "H20", TRUTH, noise=0.05)
    )
    assert fit.factors == pytest.approx(TRUTH, rel=0.1)
    assert 0.02 < fit.rms_log_error < 0.1  # the noise shows in the residuals


def test_the_engines_fixed_cost_per_prefill_call_is_taken_off_before_fitting():
    r = recipe("paper/7b.yaml")
    measured = synthetic_measurements(r, "H20", TRUTH)
    for point in measured["decode"]["points"]:
        point["prefill_s"] += 0.03  # request handling, scheduling, sampling the first token
    fit = fit_profile(pool_of(r, "H20"), r.workload.model, measured)
    assert fit.prefill_call_s == pytest.approx(0.03, rel=0.01)
    assert fit.factors == pytest.approx(TRUTH, rel=0.01)
    assert fit.rms_log_error < 0.01


def test_a_step_faster_than_peak_is_capped_and_shows_the_gap():
    r = recipe("paper/7b.yaml")
    measured = synthetic_measurements(r, "H20", TRUTH)
    measured["train"]["step_s"] /= 100
    measured["train"]["logp_s"] /= 100
    fit = fit_profile(pool_of(r, "H20"), r.workload.model, measured)
    assert fit.factors["train_mfu"] == RANGES["train_mfu"].high  # the top of the physical range
    train = fit.points[-1]
    assert train["model_s"] > 10 * train["measured_s"]


def test_one_gpu_measures_no_link():
    r = recipe("paper/7b.yaml")
    measured = synthetic_measurements(r, "H800-PCIe", TRUTH, gpus=1)
    measured["train"]["allreduce_bus_gb_per_s"] = None
    fit = fit_profile(pool_of(r, "H800-PCIe"), r.workload.model, measured)
    assert "link_efficiency" not in fit.factors and fit.factors["train_mfu"] == pytest.approx(0.33, rel=0.01)


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda m: m.update(model="Qwen2.5-14B"), "were taken with model 'Qwen2.5-14B'"),
        (lambda m: m.update(format="other"), "are not areal-hex measurements"),
        (lambda m: m["decode"].update(points=[]), "decode.points is missing or empty"),
        (lambda m: m["decode"]["points"][1].update(step_s=-1), r"decode.points\[1\].step_s must be positive"),
        (lambda m: m["train"].pop("logp_s"), "train.logp_s is missing"),
        (lambda m: m["decode"].update(tp=16), "decode.tp=16"),
        (lambda m: m.pop("train"), "train is missing"),
    ],
)
def test_malformed_measurements_name_what_is_wrong(damage, words):
    r = recipe("paper/7b.yaml")
    measured = synthetic_measurements(r, "H20", TRUTH)
    damage(measured)
    with pytest.raises(HexError, match=words):
        fit_profile(pool_of(r, "H20"), r.workload.model, measured)


def _profile(tmp_path, *extra: str) -> list[str]:
    return ["profile", "recipes/paper/7b.yaml", *extra, "--json", str(tmp_path / "h20.json")]


def test_profile_command_fits_saved_measurements_into_a_profile_recipes_use(tmp_path, capsys, monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)
    slow = dict(TRUTH, hbm_fraction=0.4, infer_mfu=0.3)
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(synthetic_measurements(recipe("paper/7b.yaml"), "H20", slow)))
    assert main(_profile(tmp_path, "--gpu-type", "h20-96gb", "--from-measurements", str(raw))) == 0
    out = capsys.readouterr().out
    assert "decode_step" in out and "rms log error" in out
    profile = tmp_path / "h20.json"
    assert read_profile(profile)["H20"] == pytest.approx(slow, rel=0.01)
    assert json.loads(profile.read_text())["fit"]["H20"]["rms_log_error"] < 0.01
    # A recipe pointing at it gets those factors; its own hex.calibration entries win over the profile.
    r = recipe(
        "paper/7b.yaml",
        f"++hex.calibration.profile={profile}",
        "++hex.calibration.gpu_types.H20.train_mfu=0.3",
    )
    cal = r.calibration
    assert cal.for_gpu("H20").infer_mfu == pytest.approx(0.3, rel=0.01)
    assert cal.for_gpu("H20").train_mfu == 0.3
    assert cal.for_gpu("H800-PCIe") == GENERIC  # the profile replaces the recipe's builtin:paper
    fitted = CostModel(r.cluster, r.workload, cal).rollout((RolloutStage("h20", 1),))
    default = CostModel(r.cluster, r.workload).rollout((RolloutStage("h20", 1),))
    assert fitted.tokens_per_s < default.tokens_per_s
    # A written profile is also valid --from-measurements input, and fits to the same factors.
    again = tmp_path / "again"
    again.mkdir()
    assert main(_profile(again, "--gpu-type", "H20", "--from-measurements", str(profile))) == 0
    assert read_profile(again / "h20.json") == read_profile(profile)


@pytest.mark.parametrize(
    ("content", "extra", "words"),
    [
        ("{", (), "not JSON"),
        ('{"format": "other"}', (), "holds no measurements"),
        ("[1]", (), "holds no measurements"),
        (None, ("--gpu-type", "H800-PCIe"), "is H800-PCIe but the measurements are of H20"),
        (None, ("--gpu-type", "Z9000"), "unknown GPU type 'Z9000'"),
        (
            None,
            ("--gpu-type", "H20", "--decode-tokens", "1"),
            "--decode-tokens: must be a whole number in [2, 10,000,000]",
        ),
        (None, ("--gpu-type", "H20", "--train-gpus", "0"), "--train-gpus: must be a whole number in [1, 72]"),
    ],
)
def test_profile_command_bad_input_exits_2_without_output(
    tmp_path, capsys, monkeypatch, content, extra, words
):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)
    raw = tmp_path / "raw.json"
    raw.write_text(content or json.dumps(synthetic_measurements(recipe("paper/7b.yaml"), "H20", TRUTH)))
    flags = extra or ("--gpu-type", "H20")
    assert main(_profile(tmp_path, *flags, "--from-measurements", str(raw))) == 2
    assert words in capsys.readouterr().err and not (tmp_path / "h20.json").exists()


def test_profile_command_without_a_gpu_says_so(tmp_path, capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)
    assert main(_profile(tmp_path, "--gpu-type", "H20")) == 2
    assert "no CUDA GPU on this machine" in capsys.readouterr().err


def test_profile_command_checks_the_training_split_before_measuring(tmp_path, capsys, monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)
    code = main(_profile(tmp_path, "--gpu-type", "H20", "--train-gpus", "8", "--train-sequences", "12"))
    assert code == 2
    assert "12 sequences do not split into 8 GPUs x 4 minibatches" in capsys.readouterr().err
