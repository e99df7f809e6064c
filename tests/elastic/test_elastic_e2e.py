"""A rollout server killed mid-step, relaunched, and served lengths that double, through the real driver.

The CI e2e run (``tests/e2e``: upstream's trainer, FSDP on 2 gloo ranks, the relay, the SGLang stand-in servers,
``hex_local``) on the hand-laid two-layout plan, with a watcher thread in the test that

1. SIGKILLs the CPU-SMALL server by its PID while it holds requests open, in the first step (the stand-in, told
   by ``HEX_STANDIN_HOLD_FILE``, answers none of them and says so once it holds ``HELD`` of them);
2. once the relaunched server has loaded a version, doubles the served output lengths (4 -> 8 tokens: the
   stand-in ends every generation after the number in ``HEX_STANDIN_LENGTHS_FILE``).

The run evaluates every 2 steps (upstream's eval-rollout workers, beside the rollout workers, on the same servers).

Checked: the run finishes its steps; the loss is detected within the stated deadline; every sample in flight on
the lost server was resubmitted and each sample accepted once; the shares were re-solved for the survivor (the
plan's ``changes``); the relaunched server loaded the version the trainer committed (same weights as the other
server's copy of it) before its first request; the shares changed within two steps of the lengths doubling.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("areal")

from tests.e2e.run import environment, new_mark, processes_left, run_driver  # noqa: E402
from tests.e2e.sglang_server import HOLD_FILE_ENV, LENGTHS_FILE_ENV  # noqa: E402
from tests.elastic.checks import committed_first_loads  # noqa: E402
from tests.elastic.plans import LONGER, elastic_recipe, two_layout_plan  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT_S = 600
# A step takes about 1 s here (2 on a loaded machine): enough of them for the lost server to be relaunched (a
# server start), join, serve and see the lengths double with steps left. 8 (one epoch of the CI data set, 64
# prompts, 8 a step) left a relaunched server that started late under load without a request.
STEPS = 12
INTERVAL_S, PROBE_TIMEOUT_S, FAILURES = 0.5, 1.0, 2
DEADLINE_S = FAILURES * (INTERVAL_S + PROBE_TIMEOUT_S)
HELD = 2  # requests the small server holds open, unanswered, when it is killed
EVERY = 2  # steps between evaluations
ELASTIC = (
    f"++hex.elastic.health_interval_s={INTERVAL_S}",
    f"++hex.elastic.health_timeout_s={PROBE_TIMEOUT_S}",
    f"++hex.elastic.failures_to_down={FAILURES}",
)


def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


class Watcher(threading.Thread):
    """Kills the small server while it holds requests open, then doubles the lengths once its replacement has
    loaded a version."""

    def __init__(self, folder: Path, held: Path, lengths: Path) -> None:
        super().__init__(daemon=True)
        self.folder, self.held, self.lengths = folder, held, lengths
        self.killed_at: float | None = None
        self.killed_log: Path | None = None
        self.doubled_at: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        servers = self.folder / "servers"
        while not self.done.wait(0.05):
            smalls = sorted(servers.glob("small-*.jsonl"))
            if self.killed_at is None:
                # The server writes the marker once it holds HELD requests and answers none of them until it
                # is killed: the state lasts, so this poll races nothing.
                if self.held.exists():
                    self._kill()
            elif self.doubled_at is None:
                for log in smalls:
                    if log != self.killed_log and any(
                        r["event"] == "load" and r["version"] != "default" for r in _records(log)
                    ):
                        self.lengths.write_text("8")
                        self.doubled_at = time.time()
            if self.doubled_at is not None:
                return

    def _kill(self) -> None:
        holder = json.loads(self.held.read_text())
        os.kill(holder["pid"], signal.SIGKILL)
        self.killed_at, self.killed_log = time.time(), Path(holder["log"])


def relocated_recipe(folder: Path) -> Path:
    """The CI recipe copied into ``folder`` with its calibration profile and its output lengths (the elastic
    tests' distribution, drawn once) in files beside it, named by relative paths: read from the recipe's folder
    wherever the run starts."""
    import random

    import yaml

    from tests.e2e.run import RECIPE, REPO

    folder.mkdir()
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["hex"]["workload"]["model"] = str(REPO / recipe["hex"]["workload"]["model"])
    recipe["hex"]["workload"]["output_lengths"] = {"kind": "file", "path": "lengths/basis.txt"}
    recipe["hex"]["calibration"] = {"profile": "profiles/cpu.json"}
    (folder / "lengths").mkdir()
    draw = random.Random(0)
    basis = [min(16, max(1, round(draw.lognormvariate(math.log(12) - 0.125, 0.5)))) for _ in range(500)]
    (folder / "lengths" / "basis.txt").write_text("".join(f"{n}\n" for n in basis))
    (folder / "profiles").mkdir()
    factors = {"train_mfu": 0.4, "hbm_fraction": 0.8}  # the built-in figures: the run behaves as from RECIPE
    profile = {"format": "areal-hex-profile/1", "gpu_types": {"CPU-BIG": factors, "CPU-SMALL": factors}}
    (folder / "profiles" / "cpu.json").write_text(json.dumps(profile))
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_a_server_lost_and_relaunched_and_lengths_that_double(tmp_path: Path) -> None:
    """Also a run from another working directory, on a recipe whose profile and lengths are relative paths."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("4")
    hold = tmp_path / "hold.json"
    hold.write_text(json.dumps({"pool": "small", "requests": HELD}))
    settings = {
        "HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2",
        LENGTHS_FILE_ENV: str(lengths),
        HOLD_FILE_ENV: str(hold),
    }
    env = environment(tmp_path, new_mark(), settings)
    plan_file = two_layout_plan(tmp_path, "hex_local", STEPS)
    watcher = Watcher(tmp_path, Path(f"{hold}.held"), lengths)
    watcher.start()
    recipe = relocated_recipe(tmp_path / "recipe")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    extra = (
        f"hex.plan_path={plan_file}",
        "total_train_epochs=2",
        LONGER[0],
        *ELASTIC,
        f"evaluator.freq_steps={EVERY}",
    )
    run = run_driver(tmp_path, "hex_local", STEPS, env, TIMEOUT_S, extra, recipe=recipe, cwd=elsewhere)
    watcher.done.set()
    assert run.returncode == 0, run.log[-6000:]
    assert watcher.killed_at is not None, "the small server was never killed"
    figures: dict = {"seconds": round(run.seconds, 1)}

    # Detected within the deadline, its in-flight samples resubmitted, each sample accepted once.
    (lost,) = re.findall(r"rollout server (\S+) lost \(.*?\) at (\d+\.\d+)", run.log)
    figures["detection_s"] = round(float(lost[1]) - watcher.killed_at, 3)
    assert 0 <= figures["detection_s"] <= DEADLINE_S + 1.0, figures
    (summary,) = re.findall(r"hex elastic summary: (\{.*\})", run.log)
    counts = json.loads(summary)
    figures["counts"] = counts
    assert counts["in_flight_at_loss"] >= 1 and counts["resubmitted"] == counts["in_flight_at_loss"], counts
    assert counts["duplicates"] == 0 and counts["rejected"] == 0, counts
    rl = elastic_recipe().workload.rl
    assert counts["accepted"] >= STEPS * rl.batch_size, counts  # prompts (samples of n_samples sequences)
    # Every step ran and was logged; the killed server answered none of its requests (at least HELD), each of an
    # in-flight sample (n_samples requests each).
    assert len(re.findall(r"hex elastic step \d+ ended", run.log)) == STEPS
    assert len([r for r in run.wandb_history() if "hex/elastic/live_servers" in r]) == STEPS
    killed = _records(watcher.killed_log)
    assert not [r for r in killed if r["event"] == "generate"], killed
    unfinished = sum(r["event"] == "request" for r in killed)
    assert HELD <= unfinished <= rl.n_samples * counts["in_flight_at_loss"], (unfinished, counts)
    figures["unfinished_requests_on_the_lost_server"] = unfinished

    # Evaluation went on through the loss and the relaunch: it routed around the lost server and followed the
    # relaunched one to its new port, so none of its requests failed.
    evaluated = [r for r in run.wandb_history() if "eval-rollout/reward" in r]
    assert len(evaluated) >= STEPS // EVERY - 1, len(evaluated)
    failed = [
        line for line in (run.trial / "eval-rollout.log").read_text().splitlines() if "failed with" in line
    ]
    assert not failed, failed[:3]

    # The plan records the changes: lost (the survivor takes everything), gained, then the drift re-balance.
    changes = run.plan["changes"]
    kinds = [c["kind"] for c in changes]
    assert "lost" in kinds and "gained" in kinds, kinds
    loss = changes[kinds.index("lost")]
    assert {name.split("/")[0]: share for name, share in loss["shares"].items()} == {
        "big-2": 1.0,
        "small-0": 0.0,
    }
    gain = changes[kinds.index("gained")]
    assert all(share > 0 for share in gain["shares"].values()), gain

    # The relaunched server loaded a committed version (the weights the big server got for it) before its
    # first request, and served nothing else.
    servers = run.server_logs()
    (new_name,) = [n for n in servers if n.startswith("small") and n != watcher.killed_log.stem]
    new = servers[new_name]
    loads = committed_first_loads(new, [rs for n, rs in servers.items() if n.startswith("big")])
    figures["relaunched_first_version"] = loads[0][1]["version"]

    # Lengths doubled: the shares changed within the next two steps.
    assert watcher.doubled_at is not None
    drifts = [c for c in changes if c["kind"] == "drift"]
    after = [
        c for c in drifts if c["step"] is not None and c["step"] >= _step_at(run.log, watcher.doubled_at)
    ]
    # A change at the end of the first step whose batch was generated after the doubling: at eta 1 the next step's
    # batch may be ready before it (once: doubled late in step 2, step 3's batch all at 4 tokens, the change at
    # the end of step 4), so at most two steps after the step the lengths doubled in.
    assert after and after[0]["step"] <= _step_at(run.log, watcher.doubled_at) + 2, (
        drifts,
        watcher.doubled_at,
    )
    before_shares = [c["shares"] for c in changes if changes.index(c) < changes.index(after[0])][-1]
    assert after[0]["shares"] != before_shares
    figures["shares"] = {c["kind"]: c["shares"] for c in changes}
    assert processes_left(run.mark, wait_s=30) == []
    print(f"\n[e2e elastic] {json.dumps(figures)}")


def _step_at(log: str, when: float) -> int:
    """The training step the run was in at time ``when`` (one past the last step the controller saw end)."""
    ended = [(int(s), float(t)) for s, t in re.findall(r"hex elastic step (\d+) ended at (\d+\.\d+)", log)]
    return 1 + max([s for s, t in ended if t <= when], default=-1)
