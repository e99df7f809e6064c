"""The core imports and plans without areal or torch: they are blocked outright in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"areal", "torch", "sglang", "ray", "wandb", "transformers"}:
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
"""

CORE_MODULES = [
    "areal_hex_plugin.cli",
    "areal_hex_plugin.errors",
    "areal_hex_plugin.specs.catalog",
    "areal_hex_plugin.specs.cluster",
    "areal_hex_plugin.specs.config",
    "areal_hex_plugin.specs.models",
    "areal_hex_plugin.specs.recipe",
    "areal_hex_plugin.specs.summary",
    "areal_hex_plugin.specs.workload",
    "areal_hex_plugin.costmodel",
    "areal_hex_plugin.planner.refit_worker",  # the online refit's worker process imports only the core
]


def test_core_needs_neither_areal_nor_torch():
    code = BLOCKER + "\n".join(
        [
            *(f"import {m}" for m in CORE_MODULES),
            "from areal_hex_plugin.cli import main",
            f"assert main(['validate', {str(REPO / 'recipes/paper/7b.yaml')!r}]) == 0",
            "assert not any(m.split('.')[0] in {'areal', 'torch'} for m in sys.modules)",
        ]
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout


def test_the_blocker_really_blocks():
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKER + "import torch"], capture_output=True, text=True, check=False
    )
    assert proc.returncode != 0
    assert "blocked: torch" in proc.stderr


# The plugin's modules that upstream's rollout worker imports besides upstream's own (areal/engines.py's imports):
# the solver (OR-Tools, which imports pandas: some 400 modules, 0.3 s and 40k objects) is the driver's alone.
WORKER_MODULES = ["areal_hex_plugin.areal.worker_slots", "areal_hex_plugin.areal.routing"]


def test_a_worker_imports_no_solver():
    solver_blocker = BLOCKER.replace(
        '{"areal", "torch", "sglang", "ray", "wandb", "transformers"}', '{"ortools", "pandas"}'
    )
    code = solver_blocker + "\n".join(f"import {m}" for m in WORKER_MODULES)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
