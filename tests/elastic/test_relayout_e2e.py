"""A re-plan applied live (``hex.elastic.auto_replan``, ``areal/elastic/relayout.py``), through the real driver on
``recipes/ci/tiny.yaml`` (hex_local, the CPU stand-in servers paced by ``tests/e2e/truth.yaml``).

The recipe believes CPU-SMALL's bandwidth 15x what it is (as ``tests/e2e/test_auto_replan_e2e.py``), so the plan
solved at start leaves big-2 idle and runs two tp1 servers on small-0. The refit at step 4 fits the figure back,
and the refit model's plan serves on big-2 and re-lays out small-0 (one tp2 server; with the trainer slowed by a
loaded machine, none): training stays as it is, so the run applies it live, one machine at a time: big-2's server
starts and serves from the trainer's next version; then small-0's two servers are drained and stopped (and, for
tp2, replaced by one server on the same GPUs, which serves from the version after). The test checks that the run
ends 0 having trained each step once with no restart, that the plan it ends on is the refit model's (big-2
serving, small-0 as that plan has it) with each machine's move and the re-plan recorded, that the new servers'
first load is a committed version and that they served, that the retired tp1 servers got no request after they
were stopped, that wandb shows ``hex/replan/live`` 1, that the refits after it (on the new layout's steps)
suggest nothing (no flapping), and that no process is left.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.areal.auto_replan import AUTO_KIND  # noqa: E402
from areal_hex_plugin.areal.elastic.relayout import RELAYOUT  # noqa: E402
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

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT_S = 600
STEPS = 32  # one epoch: a move takes 10-20 steps on a loaded machine, and the refits after it need 4


def test_a_refit_that_only_moves_rollout_servers_is_applied_live_machine_by_machine(tmp_path: Path) -> None:
    env = environment(
        tmp_path, new_mark(), {"HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2", TRUTH_ENV: str(TRUTH)}
    )
    extra = (
        SMALL_BELIEVED_FAST,
        "hex.elastic.auto_replan=true",
        "hex.calibration.refit_every=4",
        *PATIENT_PROBES,
    )
    run = run_driver(tmp_path, "hex_local", STEPS, env, TIMEOUT_S, extra)
    assert run.returncode == 0, run.log[-4000:]
    assert "going on from the recover checkpoint" not in run.log
    done = [int(s) for s in re.findall(r"Train step (\d+)/\d+ done", run.log)]
    assert done == list(range(1, STEPS + 1)), done

    # The plan the run ends on is the refit model's (written at the refit), each machine's move and the re-plan
    # recorded.
    def layouts(plan: dict) -> list:
        return sorted((g["pool"], g["tp"], g["count"]) for g in plan["rollout"]["replicas"])

    refit_plan = json.loads((run.trial / "hex_replan.json").read_text())
    assert layouts(run.plan) == layouts(refit_plan) and ("big", 1, 1) in layouts(run.plan), layouts(run.plan)
    roles = {m["host"]: m["role"] for m in run.plan["machines"]}
    assert roles["big-2"] == "rollout"
    moved = [c for c in run.plan["changes"] if c["kind"] == RELAYOUT]
    assert [c["hosts"] for c in moved] == [["big-2"], ["small-0"]], run.plan["changes"]
    assert "big-2 idle -> rollout tp1pp1 x1: 1 server started" in moved[0]["reason"]
    assert "small-0 rollout tp1pp1 x2 -> " in moved[1]["reason"] and "2 servers drained" in moved[1]["reason"]
    (change,) = [c for c in run.plan["changes"] if c["kind"] == AUTO_KIND]
    assert (
        "applied live, machine by machine" in change["reason"]
        and "automatic re-plan 1 of at most 1" in (change["reason"])
    )
    assert change["tokens_per_s_after"] > change["tokens_per_s_before"]
    # The servers: small-0's two tp1 servers, stopped; the new ones (big-2's, small-0's tp2 where the plan has
    # one) loaded a committed version first and served.
    logs = run.server_logs()
    stopped = [name for name, rs in logs.items() if name.startswith("small") and rs[0]["tp_size"] == 1]
    new = [name for name in logs if name not in stopped]
    assert len(stopped) == 2 and len(new) == len(layouts(run.plan)), (stopped, new)
    for name in new:
        loads = [r["version"] for r in logs[name] if r["event"] == "load"]
        assert loads[0] == "default" and loads[1] != "default", loads
        assert sum(r["event"] == "request" for r in logs[name]) > 0, name
    (drained,) = re.findall(
        r"(\d{8}-\d\d:\d\d:\d\d\.\d+) HexRelayout INFO: [^\n]*small-0 rollout tp1pp1 x2", run.log
    )
    stopped_at = datetime.strptime(drained, "%Y%m%d-%H:%M:%S.%f").timestamp()
    assert all(r["t"] < stopped_at for name in stopped for r in logs[name] if r["event"] == "request")
    rows = [row for row in run.wandb_history() if any(k.startswith("hex/measured/") for k in row)]
    assert any(r.get("hex/replan/live") == 1.0 for r in rows), [sorted(r) for r in rows][:2]
    # No flapping: the refits after it, on the new layout's steps (the window starts again after a re-layout),
    # find nothing better. Read from the log: the last of them may start after the last step, where no wandb row
    # follows to carry its figures; the run's closing count says every refit finished, its decision included.
    last_move = run.log.rindex("HexRelayout INFO: live re-layout")
    moved_at = int(re.findall(r"Train step (\d+)/\d+ done", run.log[:last_move])[-1])
    windows = [
        int(a) for a in re.findall(r"HexRefit INFO: refit at step \d+ \([^)]*steps (\d+)-\d+\)", run.log)
    ]
    after = [first for first in windows if first > moved_at]
    suggestions = re.findall(r"re-plan suggested by the refit model: [^\n]*", run.log)
    assert after and len(suggestions) == 1, (windows, moved_at, suggestions)  # the one is the move's own
    refits = set(re.findall(r"HexRefit (?:INFO|WARNING): refit at step (\d+)", run.log))
    assert f"online refit: {len(refits)} refits" in run.log, refits
    assert processes_left(run.mark, wait_s=30) == []
    summary = {"run_s": round(run.seconds, 1), "changes": moved + [change]}
    (tmp_path / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
