"""A training rank lost, ``areal-hex replan``, and the run resumed from upstream's recover checkpoint on the new plan.

Run 1 is the CI e2e run (``hex_local``, the hand-laid plan: FSDP dp2 on big-0 and big-1) with a watcher that
SIGKILLs the second actor worker (big-1's rank) once the servers hold version 3 and its recover dump is
complete. The run stops (exit 3, not hung) with one message whose fix is the replan and the resume, pasteable: the
replan is run as printed and the resume's command is checked to be run 1's own with the new plan. ``replan --lost
big-1`` then moves only big-0 (dp2 -> dp1) and drops big-1, the rollout machines untouched;
run 2, in the same experiment folder with ``hex.plan_path`` of the new plan, recovers from the last recover
checkpoint: its first step is the one after it, and the first version its servers load is the recovered one,
with the very weights run 1's servers had for that version.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.cli import main  # noqa: E402
from areal_hex_plugin.driver import EXIT_LOST  # noqa: E402
from areal_hex_plugin.plan import HexPlan  # noqa: E402
from areal_hex_plugin.saved_plan import without_explanations  # noqa: E402
from tests.e2e.run import MARK, RECIPE, environment, new_mark, overrides, processes_left, run_driver  # noqa: E402
from tests.e2e.sglang_server import LOG_DIR_ENV  # noqa: E402
from tests.elastic.plans import LONGER, two_layout_plan  # noqa: E402
from tests.elastic.procs import flag, kill_where  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT_S = 480
STEPS = 8
KILL_AT_VERSION = "3"


def _loads(folder: Path) -> dict[str, list[dict]]:
    """Each server's weight loads, by log name."""
    out = {}
    for path in sorted(folder.glob("*.jsonl")):
        try:
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            continue
        out[path.stem] = [r for r in records if r["event"] == "load"]
    return out


def _recovered_step(folder: Path) -> int | None:
    """The global step of upstream's last complete recover dump under ``folder`` (its step info is written last)."""
    for path in folder.rglob("recover_info/step_info.json"):
        try:
            return json.loads(path.read_text())["global_step"]
        except (OSError, ValueError, KeyError):
            return None
    return None


class ActorKiller(threading.Thread):
    """Kills the second actor once every server holds KILL_AT_VERSION and the recover dump of the step that made it
    is complete. Upstream writes the recover checkpoint in place and its step info after it, so a kill inside the
    dump leaves the next step's weights under the last step's info: a torn checkpoint this test is not about."""

    def __init__(self, folder: Path, mark: str) -> None:
        super().__init__(daemon=True)
        self.folder, self.mark = folder, mark
        self.killed = False
        self.done = threading.Event()

    def run(self) -> None:
        made_by = int(KILL_AT_VERSION) - 1  # version v is the weights after global step v - 1
        while not self.done.wait(0.05):
            loads = _loads(self.folder / "servers")
            served = loads and all(any(r["version"] == KILL_AT_VERSION for r in rs) for rs in loads.values())
            if served and (_recovered_step(self.folder) or -1) >= made_by:
                self.killed = kill_where(self.mark, _second_actor)
                return


def _second_actor(argv: list[bytes]) -> bool:
    return (
        b"areal.infra.rpc.rpc_server" in argv
        and flag(argv, b"--role") == b"actor"
        and flag(argv, b"--worker-index") == b"1"
    )


def _train_steps(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"Train step (\d+)/\d+ done", log)]


def test_a_lost_training_rank_replanned_and_resumed(tmp_path: Path, capsys) -> None:
    plan_file = two_layout_plan(tmp_path, "hex_local", STEPS)
    gpus = {"HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2"}
    env = environment(tmp_path, new_mark(), gpus)
    killer = ActorKiller(tmp_path, env["HEX_E2E_RUN"])
    killer.start()
    start = time.monotonic()
    first = run_driver(tmp_path, "hex_local", STEPS, env, TIMEOUT_S, (f"hex.plan_path={plan_file}", *LONGER))
    killer.done.set()
    assert killer.killed, first.log[-3000:]
    # Stopped, not hung, with one message whose fix is the replan and the resume, pasteable.
    assert first.returncode == EXIT_LOST and "killed after" not in first.log, first.log[-3000:]
    assert processes_left(first.mark, wait_s=30) == []
    done_before = _train_steps(first.log)
    assert done_before and len(done_before) < STEPS
    (message,) = re.findall(r"^error: training: lost big-1 \(.*\n  fix: (.*)$", first.log, flags=re.M)
    replan_cmd, resume_cmd = (shlex.split(part) for part in message.split(" && "))
    (run_plan,) = tmp_path.glob("exp/logs/*/*/trial0/hex_plan.json")
    new_plan = run_plan.with_name("hex_plan.replanned.json")
    run_overrides = [*overrides(tmp_path, "hex_local", STEPS), f"seed={int(env[MARK][:6], 16)}", *LONGER]
    assert replan_cmd == [
        "areal-hex", "replan", "--plan", str(run_plan), "--lost", "big-1", "--recipe", str(RECIPE),
        "--json", str(new_plan), *run_overrides,
    ]  # fmt: skip
    resume = (f"hex.plan_path={new_plan}",)
    assert resume_cmd == [
        sys.executable,
        "-m",
        "areal_hex_plugin.driver",
        "--config",
        str(RECIPE),
        *run_overrides,
        *resume,
    ]
    assert main(replan_cmd[1:]) == 0
    diff = capsys.readouterr().out
    changed = {line.split()[0] for line in diff.splitlines() if line.startswith(("big-", "small-"))}
    assert changed == {"big-0", "big-1"}, diff  # the rollout machines stay as they were
    replanned = json.loads(new_plan.read_text())
    assert [(s["dp"], s["hosts"]) for s in replanned["train"]["stages"]] == [(1, ["big-0"])]

    env = environment(tmp_path, new_mark(), {**gpus, LOG_DIR_ENV: str(tmp_path / "servers-resumed")})
    second = run_driver(tmp_path, "hex_local", STEPS, env, TIMEOUT_S, (*LONGER, *resume))
    assert second.returncode == 0, second.log[-6000:]
    # The plan it ran is the re-plan, its change list continued (the shares re-balanced for the served lengths).
    # The run follows the replanned file as a saved plan: without the planner's explanations, which it drops.
    followed = without_explanations(HexPlan.from_dict(replanned)).to_dict()
    assert {**second.plan, "changes": replanned["changes"]} == followed
    assert second.plan["changes"][: len(replanned["changes"])] == replanned["changes"]
    resumed = _train_steps(second.log)
    # The step counter continues from upstream's recover info (the steps its checkpoint holds: at least those the
    # killed run logged), and the recovered weights carry that version.
    (last,) = re.findall(r"Recovering from StepInfo\(.*?global_step=(\d+)", second.log)
    assert int(last) >= done_before[-1], (last, done_before)
    assert resumed == list(range(int(last) + 1, STEPS + 1)), (last, resumed)
    recovered = last
    before, after = _loads(tmp_path / "servers"), _loads(tmp_path / "servers-resumed")
    for name, records in after.items():
        (first_load, *_) = [r for r in records if r["version"] != "default"]
        assert first_load["version"] == recovered, (name, records)
        assert {r["digest"] for rs in before.values() for r in rs if r["version"] == recovered} == {
            first_load["digest"]
        }, name
    assert processes_left(second.mark, wait_s=30) == []
    print(
        f"\n[e2e replan-resume] {json.dumps({'killed_after_steps': done_before, 'resumed_steps': resumed, 'seconds': round(time.monotonic() - start, 1)})}"
    )
