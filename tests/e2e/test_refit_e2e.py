"""Issue 34's 3x case through the real driver: the recipe declares CPU-BIG's memory bandwidth 3x too low (the
run's belief), while the stand-in servers decode at the true catalog's speed (``HEX_STANDIN_TRUTH`` =
``tests/e2e/truth.yaml``, the recipe's own figures). The online refit (every 5 steps, beside the trainer) fits
the declared figure back from the servers' decode speeds, and with ``hex.elastic.auto_replan`` the live rollout
shares move to what the correct catalog plans; the change is recorded in the run's ``hex_plan.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("areal")

from areal_hex_plugin.planner import plan_recipe  # noqa: E402
from areal_hex_plugin.specs.recipe import load_recipe  # noqa: E402
from tests.e2e.run import RECIPE, TRUTH, environment, new_mark, processes_left, run_driver  # noqa: E402
from tests.e2e.sglang_server import TRUTH_ENV  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 11  # refits after steps 5 and 10
TIMEOUT_S = 900
FIGURE = "hex/calibration/CPU-BIG/hbm_tb_per_s"


def test_a_bandwidth_declared_3x_low_is_refit_and_the_live_shares_follow(tmp_path: Path) -> None:
    true_tb_per_s = yaml.safe_load(TRUTH.read_text())["gpu_catalog"]["CPU-BIG"]["hbm_tb_per_s"]
    declared = f"hex.gpu_catalog.CPU-BIG.hbm_tb_per_s={true_tb_per_s / 3}"
    believed = plan_recipe(load_recipe(RECIPE, [declared]))
    correct = plan_recipe(load_recipe(RECIPE, []))
    share = {g.pool: g.share for g in correct.rollout.replicas}
    assert [g.pool for g in believed.rollout.replicas] == list(share)  # the same servers, other shares
    assert abs(believed.rollout.replicas[0].share - share["big"]) > 0.1  # so the test can fail

    env = environment(
        tmp_path, new_mark(), {"HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2", TRUTH_ENV: str(TRUTH)}
    )
    run = run_driver(tmp_path, "hex_local", STEPS, env, TIMEOUT_S, (declared, "hex.elastic.auto_replan=true"))
    assert run.returncode == 0, run.log[-6000:]

    rows = [row for row in run.wandb_history() if any(k.startswith("hex/measured/") for k in row)]
    fitted = [row[FIGURE] for row in rows if FIGURE in row]
    assert fitted, [sorted(r) for r in rows if "hex/calibration/rms_log_error" in r]
    assert abs(fitted[-1] / true_tb_per_s - 1) <= 0.25, (fitted, true_tb_per_s)
    reshares = [c for c in run.plan["changes"] if c["kind"] == "reshare"]
    assert reshares, run.plan["changes"]
    # Servers are named host/rank, ranks in the plan's replica order.
    pool_of = [g["pool"] for g in run.plan["rollout"]["replicas"] for _ in range(g["count"])]
    by_pool = dict.fromkeys(share, 0.0)
    for name, s in reshares[-1]["shares"].items():
        by_pool[pool_of[int(name.rsplit("/", 1)[1])]] += s
    print(f"\n[e2e refit 3x] {json.dumps({'fitted': fitted, 'true': true_tb_per_s, 'shares': by_pool})}")
    assert all(abs(by_pool[p] - share[p]) <= 0.1 * share[p] for p in share), (by_pool, share, reshares)
    assert processes_left(run.mark, wait_s=30) == []
