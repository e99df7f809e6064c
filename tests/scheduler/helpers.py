"""Recipes for scheduler tests: a shipped paper recipe with its cluster replaced through ordinary overrides."""

from __future__ import annotations

from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO

PRICES = {
    "H800-PCIe": 5.28,
    "H20": 1.85,
    "A100-80GB": 2.26,
    "L40S": 1.08,
    "H100": 6.0,
    "H200": 7.5,
    "B200": 9.0,
    "A800": 2.26,
}


def recipe_with_pools(pools: list[tuple[str, int, int]], model: str = "1.5b", *extra: str):
    """``pools``: (GPU type, GPUs per machine, machines); no budget unless ``extra`` sets one."""
    items = ", ".join(
        f"{{name: p{i}, gpu_type: {t}, gpus_per_machine: {g}, machines: {m}, price_per_gpu_hour: {PRICES[t]}, "
        "inter_machine_gb_per_s: 5.0}"
        for i, (t, g, m) in enumerate(pools)
    )
    overrides = [f"hex.cluster.pools=[{items}]", "hex.objective.budget_per_hour=null", *extra]
    return load_recipe(REPO / "recipes" / "paper" / f"{model}.yaml", overrides)
