"""A bandwidth the recipe declares 3x too low, refit from the run (issue 34's first case), through the real driver
on ``recipes/ci/tiny.yaml`` (hex_local).

The stand-in servers decode at the true catalog's speed (``tests/e2e/truth-slow.yaml``: the CPU e2e's truth at a
third of its bandwidths, a pace a stand-in keeps beside a loaded pytest); the recipe's ``hex.gpu_catalog`` (the
belief) has CPU-SMALL right and CPU-BIG's ``hbm_tb_per_s`` at a third of the true figure, so the plan solved at start
splits the samples about evenly where the true figures give CPU-BIG's server 3/4. With ``hex.elastic.auto_replan``
(``max_auto_replans=0``: shares change live, nothing restarts) the refits at steps 5 and 10 fit the figure from what
the servers serve and re-share. The test checks that by step 10 the refit's figure is within 25% of the true one and
the live shares within 10% of what the correct catalog plans, and that with the refit off they would not be: the
shares would stay the believed plan's (nothing else moves them on this run), which the planner puts outside that
band. ``benchmarks/refit_declared.py`` runs the refit-off run too, and the no-change runs on correct factors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("areal")

from areal_hex_plugin.planner import plan_recipe  # noqa: E402
from areal_hex_plugin.specs.recipe import load_recipe  # noqa: E402
from tests.e2e.run import PATIENT_PROBES, RECIPE, environment, new_mark, processes_left, run_driver  # noqa: E402
from tests.e2e.sglang_server import TRUTH_ENV  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT_S = 600
STEPS = 11  # refits at steps 5 and 10 (hex.calibration.refit_every: 5, the default)
TRUTH = Path(__file__).with_name("truth-slow.yaml")
FIGURE = "hex/calibration/CPU-BIG/hbm_tb_per_s"
FIGURE_BAND, SHARE_BAND = 0.25, 0.10  # issue 34: the figure within 25%, the shares within 10%, by step 10


def _catalog(big_divided_by: float) -> list[str]:
    """The true catalog's bandwidths as ``hex.gpu_catalog`` overrides, CPU-BIG's divided by ``big_divided_by``."""
    catalog = yaml.safe_load(TRUTH.read_text())["gpu_catalog"]
    return [
        f"hex.gpu_catalog.{gpu}.hbm_tb_per_s={spec['hbm_tb_per_s'] / (big_divided_by if gpu == 'CPU-BIG' else 1)}"
        for gpu, spec in catalog.items()
    ]


def _within(shares: dict[str, float], planned: dict[str, float]) -> bool:
    return all(abs(shares.get(pool, 0.0) - share) <= SHARE_BAND * share for pool, share in planned.items())


def test_a_bandwidth_declared_3x_too_low_is_refit_and_the_shares_follow(tmp_path: Path) -> None:
    true = yaml.safe_load(TRUTH.read_text())["gpu_catalog"]["CPU-BIG"]["hbm_tb_per_s"]
    declared = _catalog(3)
    correct = {g.pool: g.share for g in plan_recipe(load_recipe(RECIPE, _catalog(1))).rollout.replicas}
    believed = {g.pool: g.share for g in plan_recipe(load_recipe(RECIPE, declared)).rollout.replicas}
    assert not _within(believed, correct), (believed, correct)  # what the run keeps with the refit off

    env = environment(
        tmp_path, new_mark(), {"HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2", TRUTH_ENV: str(TRUTH)}
    )
    extra = (*declared, "hex.elastic.auto_replan=true", "hex.elastic.max_auto_replans=0", *PATIENT_PROBES)
    run = run_driver(tmp_path, "hex_local", STEPS, env, TIMEOUT_S, extra)
    assert run.returncode == 0, run.log[-4000:]
    started_on = {g["pool"]: g["share"] for g in run.plan["rollout"]["replicas"]}
    assert started_on == believed, started_on

    rows = [r for r in run.wandb_history() if any(k.startswith("hex/measured/") for k in r)]
    # A refit's figures are logged with the step after it: (the refit's step, the figure) for the refits to step 10.
    fitted = [(step - 1, r[FIGURE]) for step, r in enumerate(rows, 1) if FIGURE in r and step - 1 <= 10]
    assert fitted, [sorted(r) for r in rows][:2]
    assert abs(fitted[-1][1] / true - 1) <= FIGURE_BAND, (fitted, true)
    reshares = [c for c in run.plan["changes"] if c["kind"] == "reshare"]
    assert reshares and all(c["step"] <= 10 and c["reason"].startswith("refit at step") for c in reshares)
    shares = run.shares_per_pool()
    assert _within(shares, correct), (shares, correct)
    assert processes_left(run.mark, wait_s=30) == []
    summary = {
        "run_s": round(run.seconds, 1),
        "true": true,
        "declared": true / 3,
        "fitted": fitted,
        "believed_shares": believed,
        "correct_shares": correct,
        "live_shares": shares,
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
