"""``areal-hex reproduce`` writes every key the issue lists, from real plans and simulations."""

from __future__ import annotations

import json

import pytest

from areal_hex_plugin.cli import main
from tests.cli.test_documented_examples import EXAMPLES, _argv, run_documented

pytestmark = pytest.mark.slow


def test_reproduce_writes_the_paper_tables_and_json(tmp_path, capsys):
    """The documented example (test_documented_examples leaves it to this test), and what it wrote."""
    (documented,) = [command for _, command in EXAMPLES if command.startswith("reproduce")]
    assert documented == "reproduce --json OUT --plots DIR"
    plots = tmp_path / "plots"
    plots.mkdir()
    out = plots / "out.json"
    printed = run_documented(_argv(documented, plots), f"docs: areal-hex {documented}", capsys.readouterr)
    data = json.loads(out.read_text())
    for model in ("1.5B", "7B", "14B"):
        assert {"hex_tokens_per_s", "h800_tokens_per_s", "h20_tokens_per_s"} <= set(
            data["equal_budget"][model]
        )
        assert set(data["equal_throughput"][model]) == {
            "hex_tokens_per_s",
            "hex_cost_per_hour",
            "h800_tokens_per_s",
            "h800_cost_per_hour",
        }
        assert set(data["ablation"][model]) == {"uniform_tokens_per_s", "optimized_tokens_per_s"}
        assert all(
            v > 0
            for row in ("equal_budget", "equal_throughput", "ablation")
            for v in data[row][model].values()
        )
        # The equal-throughput baseline is 24 H800 at the paper's price; the hex cluster costs at most $86.64/h.
        assert data["equal_throughput"][model]["h800_cost_per_hour"] == pytest.approx(126.72)
        assert data["equal_throughput"][model]["hex_cost_per_hour"] <= 86.64 + 1e-6
        assert data["plans"][f"{model}.equal_budget.h800"]["gpus"] == {"H800-PCIe": 24}
        assert data["plans"][f"{model}.equal_budget.hex"]["cost_per_hour"] <= 126.72 + 1e-6
        # The paper's testbed, rented by the GPU: 68 H20 at $125.80/h, and a 56-GPU mix within $126.72/h.
        assert data["plans"][f"{model}.equal_budget.h20"]["cluster_gpus"] == {"H20": 68}
        hex_cluster = data["plans"][f"{model}.equal_budget.hex"]["cluster_gpus"]
        assert (
            sum(hex_cluster.values()) == 56
            and 5.28 * hex_cluster["H800-PCIe"] + 1.85 * hex_cluster["H20"] <= 126.72
        )
        # AReaL as the paper ran it (one batch admitted, weights every step) trails the same 24 H800 in the
        # recipe's runtime; the paper's layouts (types mixed across training stages) are a superset of the
        # runnable ones, and train on the H20 the runnable plan leaves idle (FSDP has no pipeline stages).
        plans = data["plans"]
        areal = plans[f"{model}.equal_budget.h800_areal_runtime"]
        assert areal["gpus"] == {"H800-PCIe": 24}
        assert (
            areal["predicted_tokens_per_s"]
            < 0.5 * plans[f"{model}.equal_budget.h800"]["predicted_tokens_per_s"]
        )
        paper, runnable = plans[f"{model}.equal_budget.hex_paper_layouts"], plans[f"{model}.equal_budget.hex"]
        assert paper["predicted_tokens_per_s"] > runnable["predicted_tokens_per_s"]
        assert paper["gpus"]["H20"] > runnable["gpus"]["H20"]
        # The equal-throughput cluster is 8 H800 + 24 H20; its plan trains on the H800 and generates on H20.
        small = data["plans"][f"{model}.equal_throughput.hex"]
        assert small["cluster_gpus"] == {"H800-PCIe": 8, "H20": 24}
        assert all(0 < small["gpus"].get(t, 0) <= n for t, n in small["cluster_gpus"].items()), small
        # The ablation: an even GPU split loses to the optimized one.
        assert (
            data["ablation"][model]["uniform_tokens_per_s"]
            < data["ablation"][model]["optimized_tokens_per_s"]
        )
        for cluster in ("equal_budget.hex", "equal_budget.h800", "equal_budget.h20", "ablation.uniform"):
            phases = data["phases"][model][cluster]
            assert set(phases) == {"rollout_s", "train_s", "weight_sync_s"} and min(phases.values()) > 0
        # The paper's AReaL runs as they ran, by the runtime and factors plan uses (issue 33): within 15% of the
        # paper's figures but the one the calibration names unexplained (14B on H800: rollout 683 s vs 1,050 s).
        for cluster, run in data["as_measured"][model].items():
            assert {"rollout_s", "train_s", "tokens_per_s"} <= set(run)
            for key in ("rollout_s", "train_s", "tokens_per_s"):
                error = run[key] / run["measured"][key] - 1
                named = model == "14B" and cluster == "h800" and key != "train_s"
                assert (abs(error) > 0.15) == named, (model, cluster, key, error)
        assert data["equal_budget"][model]["h800_as_measured_tokens_per_s"] == pytest.approx(
            data["as_measured"][model]["h800"]["tokens_per_s"]
        )
        assert set(data["per_dollar"][model]) == {"24", "32", "40", "56"}
        assert all(v > 0 for v in data["per_dollar"][model].values())
    assert set(data["scheduler_time_s"]) == {"24", "32", "40", "56"}
    assert "Equal budget" in printed
    # One figure per simulated plan, every pool's timeline in it.
    figures = list(plots.glob("*.png"))
    assert sorted(p.name for p in figures) == sorted(f"{key}.png" for key in data["plans"])
    assert all(p.stat().st_size > 0 for p in figures)


def test_reproduce_refuses_a_folder_without_the_paper_recipes(tmp_path, capsys):
    assert main(["reproduce", "--recipes", str(tmp_path)]) == 2
    assert "--recipes" in capsys.readouterr().err
