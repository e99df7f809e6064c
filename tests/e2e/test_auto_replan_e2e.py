"""A re-plan the run applies on its own (``hex.elastic.auto_replan``, ``areal/auto_replan.py``), through the real
driver on ``recipes/ci/tiny.yaml`` (hex_local, the CPU stand-in servers paced by ``tests/e2e/truth.yaml``).

The recipe believes CPU-SMALL's bandwidth 15x what it is (``hex.gpu_catalog.CPU-SMALL.hbm_tb_per_s=3e-05``, the
truth 2e-06), so the plan solved at start leaves big-2 idle and sends every sample to CPU-SMALL's two tp1 servers.
The refit at step 6 (``hex.calibration.refit_every=6``: after the 2 warm-up steps a window of 4; on a loaded machine
two steps' train phases differed 3.3-3.7x in runs here, and a 2-step window holding two such steps put the refit's
uncertainty, the gain a change must beat, at +156-173%, about this test's gain) fits the figure back from what that
server serves, and the refit model's plan puts big-2 back to rollout. With ``hex.elastic.live_relayout=false`` (the
live path is ``tests/elastic/test_relayout_e2e.py``) the run saves upstream's recover checkpoint at the end of the
next step, records the change in the plan and stops, and the driver starts itself again on the new plan from that
checkpoint, with no command pasted. The test checks that the run ends 0 having trained each step once (the restarted
run begins at the step after the checkpoint), that the final plan runs big-2 as a rollout server and records the
change with its reason, that big-2's server served after the restart, that wandb's offline rows of the first run
show ``hex/replan/restart`` 1, and that no process is left.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.areal.auto_replan import AUTO_KIND  # noqa: E402
from tests.e2e.run import (  # noqa: E402
    PATIENT_PROBES,
    SMALL_BELIEVED_FAST,
    TRUTH,
    environment,
    new_mark,
    processes_left,
    run_driver,
)
from tests.e2e.sglang_server import TRUTH_ENV  # noqa: E402
from tests.e2e.wandb_log import history  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT_S = 400
STEPS = 9


def test_a_refit_that_moves_a_machine_restarts_the_run_on_the_new_plan_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    env = environment(
        tmp_path, new_mark(), {"HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2", TRUTH_ENV: str(TRUTH)}
    )
    extra = (
        SMALL_BELIEVED_FAST,
        "hex.elastic.auto_replan=true",
        "hex.elastic.live_relayout=false",
        "hex.calibration.refit_every=6",
        *PATIENT_PROBES,
    )
    run = run_driver(tmp_path, "hex_local", STEPS, env, TIMEOUT_S, extra)
    assert run.returncode == 0, run.log[-4000:]
    # The driver restarted itself on the plan it wrote, with the refit profile, from the checkpoint after step S.
    restarted = re.search(r"going on from the recover checkpoint after step (\d+):\n +(.*)\n", run.log)
    assert restarted, run.log[-4000:]
    step, command = int(restarted.group(1)), restarted.group(2)
    assert command.endswith(
        f"{SMALL_BELIEVED_FAST} hex.elastic.auto_replan=true hex.elastic.live_relayout=false "
        "hex.calibration.refit_every=6 "
        f"{' '.join(PATIENT_PROBES)} "
        f"hex.plan_path={run.trial}/"
        f"hex_plan.auto1.json hex.calibration.profile={run.trial}/hex_profile.json"
    )
    assert 7 <= step < STEPS  # after the refit at step 6, with a step left to train
    # Every step trained once: the run before the restart up to S, the restarted run from S + 1 (upstream's
    # recovery), none from 0 again.
    done = [int(s) for s in re.findall(r"Train step (\d+)/\d+ done", run.log)]
    assert done == list(range(1, STEPS + 1)), done
    # The plan the run ends on: big-2 a rollout server, the change recorded with its reason.
    roles = {m["host"]: m["role"] for m in run.plan["machines"]}
    assert roles["big-2"] == "rollout" and {g["pool"] for g in run.plan["rollout"]["replicas"]} >= {"big"}
    (change,) = [c for c in run.plan["changes"] if c["kind"] == AUTO_KIND]
    assert "big-2" in change["hosts"] and change["step"] == step - 1  # upstream's global step, from 0
    assert "big-2: idle -> rollout tp1pp1 x1" in change["reason"]
    assert re.match(r"refit at step 6: the refit model plans [\d,]+ tokens/s against", change["reason"])
    assert f"applied at the recover checkpoint after step {step} (global step {step - 1})" in change["reason"]
    assert "automatic re-plan 1 of at most 1" in change["reason"]
    assert change["tokens_per_s_after"] > change["tokens_per_s_before"]
    # big-2's server served after the restart.
    assert run.requests_per_pool()["big"] > 0
    # wandb: the first run's offline rows show the refit that restarted it.
    runs = sorted(run.folder.glob("exp/logs/*/*/trial0/wandb/offline-run-*/run-*.wandb"))
    rows = [row for path in runs for row in history(path)]
    assert any(r.get("hex/replan/restart") == 1.0 for r in rows), [sorted(r) for r in rows][:2]
    assert processes_left(run.mark, wait_s=30) == []
    summary = {"run_s": round(run.seconds, 1), "restart_after_step": step, "change": change}
    (tmp_path / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
