"""The plan you see is the plan that runs: ``areal-hex plan --json`` and the driver's dry run with ``hex.plan_out``
give the same predicted tokens/s, $/h and layouts, for every shipped recipe and for the mixes at three budgets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.cli import main as cli_main  # noqa: E402
from areal_hex_plugin.driver import main as driver_main  # noqa: E402
from areal_hex_plugin.specs.recipe import load_recipe  # noqa: E402
from tests.conftest import RECIPES  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Fractions of a mix's whole inventory price.
BUDGET_FRACTIONS = (0.35, 0.65, 1.0)


def _cases() -> list[tuple[Path, list[str]]]:
    cases = [(recipe, []) for recipe in RECIPES]
    for recipe in RECIPES:
        if recipe.parent.name == "mixes":
            price = load_recipe(recipe).cluster.price_per_hour
            cases += [
                (recipe, [f"++hex.objective.budget_per_hour={f * price:.2f}"]) for f in BUDGET_FRACTIONS
            ]
    return cases


def _shape(plan: dict) -> dict:
    """What must agree: the prediction, the runtime and every layout."""
    return {
        "tokens_per_s": plan["predicted"]["tokens_per_s"],
        "cost_per_hour": plan["predicted"]["cost_per_hour"],
        "runtime": plan["runtime"],
        "train": [(s["pool"], s["gpu_type"], s["dp"], s["tp"], s["layers"]) for s in plan["train"]["stages"]],
        "rollout": [
            (g["pool"], g["gpu_type"], g["tp"], g["pp"], g["count"], g["concurrency"], g["samples_per_step"])
            for g in plan["rollout"]["replicas"]
        ],
        "machines": [(m["host"], m["role"]) for m in plan["machines"]],
    }


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    _cases(),
    ids=lambda x: x.stem if isinstance(x, Path) else (x[0].split("=")[1] if x else "recipe"),
)
@pytest.mark.usefixtures("transport_token")
def test_plan_and_driver_dry_run_agree(recipe: Path, overrides: list[str], tmp_path: Path, capsys) -> None:
    shown, run = tmp_path / "shown.json", tmp_path / "run.json"
    assert cli_main(["plan", str(recipe), *overrides, "--json", str(shown)]) == 0
    (tmp_path / "nr").mkdir()
    argv = [
        "--config", str(recipe), f"cluster.fileroot={tmp_path}", f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}",
        "scheduler.type=hex_local", "hex.dry_run=true", f"hex.plan_out={run}", *overrides,
    ]  # fmt: skip
    capsys.readouterr()
    assert driver_main(argv) == 0
    printed = capsys.readouterr().out
    a, b = json.loads(shown.read_text()), json.loads(run.read_text())
    assert _shape(a) == _shape(b)
    assert a["runtime"].startswith("fsdp + sglang")  # the shipped recipes train with FSDP
    assert f"Predicted: {b['predicted']['tokens_per_s']:,.0f} tokens/s" in printed
    # The dry run's placement starts every replica group with its own layout and planned concurrency.
    for g in b["rollout"]["replicas"]:
        assert (
            f"x tp{g['tp']} pp{g['pp']}" in printed and f"max_running_requests={g['concurrency']}" in printed
        )
