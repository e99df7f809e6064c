"""A machine joins a running plan (``areal-hex join``), through the real driver.

The CI e2e run (``tests/e2e``: upstream's trainer, FSDP on 2 gloo ranks, the relay, the SGLang stand-in servers,
``hex_local`` with two CPU-SMALL GPUs more than the plan uses) on the hand-laid two-layout plan (a tp1 server on
big-2, a tp2 server on small-0). Once the servers hold a committed version, the test runs
``areal-hex join --plan <the run's hex_plan.json> --pool small --host small-1``.

Checked: the run finishes its steps; the new server runs on the node's free CPU-SMALL GPUs with its pool's planned
layout; its first load is a version the trainer committed, with the very weights the other servers loaded for it,
before its first request, and it serves nothing else; the plan records a ``gained`` change naming the join request
with shares over three servers, and wandb ``hex/elastic/joined``; every sample is accepted once and none rejected.
The run evaluates every 4 steps (upstream's eval-rollout workers, one beside each rollout worker): an eval-rollout
worker starts beside the new server, and no evaluation request fails.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.cli import main  # noqa: E402
from tests.e2e.run import PATIENT_PROBES, environment, new_mark, processes_left, run_driver  # noqa: E402
from tests.elastic.checks import committed_first_loads  # noqa: E402
from tests.elastic.plans import LONGER, elastic_recipe, two_layout_plan  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT_S = 600
# A step takes 2-3 s here; the new machine's worker and server take 15-40 s to start on a busy machine, so it joins
# with steps left.
STEPS = 20
# Probes every 0.5 s notice the joined server holding the version soon; no server is lost here, so a starved one's
# probe may take its time.
ELASTIC = ("++hex.elastic.health_interval_s=0.5", *PATIENT_PROBES)
EVAL_EVERY = 4  # steps between evaluations


def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


class Joiner(threading.Thread):
    """Asks for small-1 to join once the run's plan is written and a server holds a committed version."""

    def __init__(self, folder: Path) -> None:
        super().__init__(daemon=True)
        self.folder = folder
        self.code: int | None = None
        self.asked_at: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            plans = list(self.folder.glob("exp/logs/*/*/trial0/hex_plan.json"))
            logs = (self.folder / "servers").glob("*.jsonl")
            loaded = any(
                r["event"] == "load" and r["version"] != "default" for p in logs for r in _records(p)
            )
            if plans and loaded:
                self.asked_at = time.time()
                self.code = main(["join", "--plan", str(plans[0]), "--pool", "small", "--host", "small-1"])
                return


def test_a_machine_joins_and_serves_the_current_version(tmp_path: Path) -> None:
    env = environment(tmp_path, new_mark(), {"HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:4"})
    plan_file = two_layout_plan(tmp_path, "hex_local", STEPS)
    joiner = Joiner(tmp_path)
    joiner.start()
    run = run_driver(
        tmp_path,
        "hex_local",
        STEPS,
        env,
        TIMEOUT_S,
        (f"hex.plan_path={plan_file}", *LONGER, *ELASTIC, f"evaluator.freq_steps={EVAL_EVERY}"),
    )
    joiner.done.set()
    assert run.returncode == 0, run.log[-6000:]
    assert joiner.code == 0, run.log[-3000:]
    figures: dict = {"seconds": round(run.seconds, 1)}

    # The new server: small-1's worker on the node's two free CPU-SMALL GPUs, with small's planned layout.
    servers = run.server_logs()
    starts = {name: records[0] for name, records in servers.items()}
    (new_name,) = [n for n, start in starts.items() if start["planned_gpu_ids"] == "5 6"]
    assert starts[new_name]["tp_size"] == 2 and starts[new_name]["max_running_requests"] == 4, starts[
        new_name
    ]
    new = servers[new_name]

    # Its first load is a committed version with the weights the others loaded for it, before its first request;
    # it serves no other version.
    loads = committed_first_loads(new, [rs for n, rs in servers.items() if n != new_name])
    first_request = next(i for i, r in enumerate(new) if r["event"] == "request")
    figures["joined_first_version"] = loads[0][1]["version"]
    figures["joined_requests"] = sum(r["event"] == "request" for r in new)
    figures["asked_to_first_request_s"] = round(new[first_request]["t"] - joiner.asked_at, 1)
    # That version was the trainer's current one: every other server loaded it at the same update.
    first = loads[0][1]
    for name, records in servers.items():
        at = [r["t"] for r in records if r["event"] == "load" and r["version"] == first["version"]]
        assert name == new_name or (at and abs(at[0] - first["t"]) < 10), (name, first, at)

    # The plan records the join: shares over the three servers, all serving.
    (gain,) = [c for c in run.plan["changes"] if c["kind"] == "gained"]
    assert "join request 0" in gain["reason"] and gain["hosts"] == ["small-1/2"], gain
    assert sorted(gain["shares"]) == ["big-2/0", "small-0/1", "small-1/2"], gain
    assert all(share > 0 for share in gain["shares"].values()) and gain["shares"][
        "small-1/2"
    ] == pytest.approx(gain["shares"]["small-0/1"]), gain
    figures["shares"] = gain["shares"]
    last = [r for r in run.wandb_history() if "hex/elastic/joined" in r][-1]
    assert last["hex/elastic/joined"] == 1 and last["hex/elastic/live_servers"] == 3, last

    # Evaluation went on: an eval-rollout worker beside the new server, evaluation routed by the shares over the
    # three (the driver evaluates at temperature 0.6, trains at 1.0), and none of its requests failed.
    assert re.search(r"Forked worker eval-rollout-rollout-join0/0 created", run.log), run.log[-3000:]
    figures["joined_eval_requests"] = sum(r["event"] == "request" and r["temperature"] == 0.6 for r in new)
    assert figures["joined_eval_requests"] > 0, figures
    evaluated = [r for r in run.wandb_history() if "eval-rollout/reward" in r]
    assert len(evaluated) >= STEPS // EVAL_EVERY - 1, len(evaluated)
    logs = sorted(run.trial.glob("eval-rollout*.log"))  # the workers started with the run and the one beside
    assert len(logs) == 2, logs
    failed = [line for log in logs for line in log.read_text().splitlines() if "failed with" in line]
    assert not failed, failed[:3]

    # Each sample accepted once, none rejected; every step ran.
    (summary,) = re.findall(r"hex elastic summary: (\{.*\})", run.log)
    counts = json.loads(summary)
    figures["counts"] = counts
    assert counts["duplicates"] == 0 and counts["rejected"] == 0 and counts["joined"] == 1, counts
    assert counts["accepted"] >= STEPS * elastic_recipe().workload.rl.batch_size, counts
    assert len(re.findall(r"hex elastic step \d+ ended", run.log)) == STEPS
    assert processes_left(run.mark, wait_s=30) == []
    print(f"\n[e2e join] {json.dumps(figures)}")
