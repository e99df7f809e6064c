"""The paper calibration (``builtin:paper``) is the documented fit to AReaL's measured homogeneous runs, and the
planner reproduces those runs phase by phase (paper.md §5.3-5.5; ``recipes/paper/baselines.json``).

Nothing here compares with a mixed-cluster result: those are predictions (``areal-hex reproduce``).
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from areal_hex_plugin.costmodel.calibration import BUILTIN, RANGES
from areal_hex_plugin.planner.fit_baselines import as_measured, setting_from
from areal_hex_plugin.sim.baselines import baseline_phases
from tests.cli.test_documented_examples import EXAMPLES, _argv, run_documented
from tests.conftest import REPO
from tests.costmodel.helpers import recipe

BASELINES = json.loads((REPO / "recipes/paper/baselines.json").read_text())
SHIPPED = json.loads((BUILTIN / "paper.json").read_text())
MODELS = ("1.5b", "7b", "14b")


def _recipes() -> dict:
    loaded = [recipe(f"paper/{m}.yaml") for m in MODELS]
    return {r.workload.model.name: r for r in loaded}


@pytest.fixture(scope="module")
def fit(tmp_path_factory) -> dict:
    """What the documented ``areal-hex calibrate --baselines BASELINES --json OUT`` writes (the fit to the paper's
    runs, on the paper's recipes), run once as documented: test_documented_examples leaves the example to this
    module (a fit takes about 20 s of CI)."""
    (documented,) = [command for _, command in EXAMPLES if command.startswith("calibrate")]
    assert documented == "calibrate --baselines BASELINES --json OUT"
    folder = tmp_path_factory.mktemp("calibrate")
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(out), redirect_stderr(err):
        patch.chdir(REPO)  # the placeholders are paths in the repository
        argv = _argv(documented, folder)
        run_documented(argv, f"docs: areal-hex {documented}", lambda: (out.getvalue(), err.getvalue()))
    return json.loads(Path(argv[argv.index("--json") + 1]).read_text())


def test_every_factor_of_the_paper_profile_names_its_source():
    for gpu_type, factors in SHIPPED["gpu_types"].items():
        for key in factors:
            source = SHIPPED["sources"][gpu_type][key]
            assert source.startswith(("fit to baselines.json", "assumed default")), (gpu_type, key, source)
    cal = recipe("paper/7b.yaml").calibration
    assert cal.source("H800-PCIe", "train_mfu").startswith("fit to baselines.json: h800")
    assert cal.for_gpu("H20").train_mfu == SHIPPED["gpu_types"]["H20"]["train_mfu"]


def test_every_shipped_factor_lies_in_its_physical_range_and_no_step_is_fixed():
    for gpu_type, factors in SHIPPED["gpu_types"].items():
        assert set(factors) == set(RANGES), gpu_type  # train_fixed_s is gone
        for key, value in factors.items():
            assert value in RANGES[key], (gpu_type, key, value)


def _explained(point: dict, unexplained: list[dict]) -> bool:
    """Whether the fit explains ``point`` (its measurement is not among those it names unexplained)."""
    label = f"{point['cluster']} {point['phase']} of {point['model']}"
    table = f"{point['phase'].split('_per_gpu')[0]} tokens/s per GPU"
    return not any(
        u["measurement"].startswith(label)
        or (table in u["measurement"] and point["model"] in u["measurement"])
        for u in unexplained
    )


@pytest.mark.slow
def test_the_runs_as_measured_within_15_percent_but_the_one_the_fit_names():
    """Issue 33: each measured run as it ran (the profile's measured setting: GPUs, staleness bound, layout,
    split; its own tokens per step), priced by the runtime and factors plan uses: every phase and the paper's
    metric within 15%, except the run the fit cannot explain with factors inside their ranges (14B on H800: its
    rollout seconds would need an HBM fraction of 0.23), which it names."""
    data = BASELINES
    off = []
    for name, r in _recipes().items():
        for cluster, run in as_measured(setting_from(r), r.calibration, data).items():
            for key in ("rollout_s", "train_s", "weight_sync_s", "tokens_per_s"):
                if abs(run[key] / run["measured"][key] - 1) > 0.15:
                    off.append((name, cluster, key))
    assert off == [
        ("DeepSeek-R1-Distill-Qwen-14B", "h800", "rollout_s"),
        ("DeepSeek-R1-Distill-Qwen-14B", "h800", "tokens_per_s"),
    ]
    assert [u["measurement"] for u in SHIPPED["unexplained"]][0].startswith(
        "h800 rollout_s of DeepSeek-R1-Distill-Qwen-14B"
    )


@pytest.mark.slow
def test_the_plan_on_the_measured_clusters_gives_the_measured_metric():
    """The planner's own plan on each measured cluster in the measured setting (its split its own choice): the
    paper's metric and the weight sync within 15%, but for the run the fit names unexplained."""
    rows = baseline_phases(
        _recipes(), recipe("paper/7b.yaml").calibration, BASELINES, SHIPPED["cluster_gpus"]
    )
    assert len(rows) == 3 * 2 * 4
    for row in rows:
        if row["phase"] in ("tokens_per_s", "weight_sync_s") and not (
            row["model"].endswith("14B") and row["cluster"] == "h800"
        ):
            assert row["model_value"] == pytest.approx(row["measured"], rel=0.15), row


@pytest.mark.slow
def test_the_shipped_profile_is_what_the_fit_gives(fit):
    for gpu_type, factors in SHIPPED["gpu_types"].items():
        assert fit["gpu_types"][gpu_type] == pytest.approx(factors, rel=1e-3), gpu_type
    assert fit["sources"] == SHIPPED["sources"]
    assert fit["cluster_gpus"] == SHIPPED["cluster_gpus"]
    eta = fit["measured_setting"]["max_head_offpolicyness"]
    assert eta == SHIPPED["measured_setting"]["max_head_offpolicyness"]
    assert [u["measurement"] for u in fit["unexplained"]] == [
        u["measurement"] for u in SHIPPED["unexplained"]
    ]
    # Each point names the type whose factors it fitted: its misses are that type's interval (planner/interval.py).
    assert [(p["phase"], p["gpu_type"]) for p in fit["points"]] == [
        (p["phase"], p["gpu_type"]) for p in SHIPPED["points"]
    ]


@pytest.mark.slow
def test_the_fit_names_what_no_physical_factors_explain_and_keeps_one_runtime(fit):
    """Issue 33: the runs are fitted in upstream 1.0.4's loop, the runtime of every command, their staleness
    bound fitted per model (eta 1 for all three: eta 0 waits for the longest sample and is 2-3x too slow, eta >= 2
    overlaps it and is 8-46% too fast). Three measurements need a factor outside its physical range (the H20/H800
    rollout ratios of Table 1 are flat over the models, 0.95-0.96, the model's 0.80-1.14); the fit keeps the
    factors inside and names them, with the value they would need."""
    assert fit["measured_setting"]["max_head_offpolicyness"] == dict.fromkeys(_recipes(), 1)
    named = {u["measurement"]: u for u in fit["unexplained"]}
    assert list(named) == [
        "h800 rollout_s of DeepSeek-R1-Distill-Qwen-14B (eta 1)",
        "Table 1 rollout tokens/s per GPU, h20 over h800, of DeepSeek-R1-Distill-Qwen-7B",
        "Table 1 rollout tokens/s per GPU, h20 over h800, of DeepSeek-R1-Distill-Qwen-1.5B",
    ]
    for u in named.values():
        assert "puts hbm_fraction at" in u["needs"] and "outside its physical range" in u["needs"]
        assert abs(u["model_value"] / u["measured"] - 1) > 0.15


@pytest.mark.slow
def test_the_h20_runs_and_table_1_agree_on_32_gpus(fit):
    """The paper does not state its H20 count. Table 1's per-GPU speeds (against the fitted H800) and the H20
    runs' steps agree, within 15%, on 4 machines (32 GPUs), not on the 68 the budget buys: the points the fit
    computes now, not the ones stored in the profile; but for the one the fit names unexplained."""
    assert BASELINES["clusters"]["h20"]["gpus"] is None
    assert fit["cluster_gpus"] == {"h800": 24, "h20": 32}
    h20 = [p for p in fit["points"] if p["cluster"] == "h20"]
    assert len([p for p in h20 if "(Table 1)" in p["phase"]]) == 2 * len(MODELS)
    for point in h20:
        if _explained(point, fit["unexplained"]):
            assert point["model_value"] == pytest.approx(point["measured"], rel=0.15), point
