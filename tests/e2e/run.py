"""One run of the real driver on ``recipes/ci/tiny.yaml`` as a subprocess, and what it left behind to check.

Everything in the loop is upstream's or the plugin's, except the rollout servers (``tests.e2e.sglang_server.py``).
Every process the run starts carries ``HEX_E2E_RUN=<id>`` in its environment, so leftovers can be found.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from tests.e2e.assets import write_assets
from tests.e2e.sglang_server import LOG_DIR_ENV
from tests.e2e.wandb_log import history

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "ci" / "tiny.yaml"
# The CPU e2e's true catalog: HEX_STANDIN_TRUTH paces the stand-in servers by it (tests/e2e/sglang_server.py).
TRUTH = REPO / "tests" / "e2e" / "truth.yaml"
# The recipe believing CPU-SMALL's bandwidth 15x its truth (2e-06): the plan solved at start leaves big-2 idle and
# runs two tp1 servers on small-0; a refit fits the figure back (the re-plan e2e's and the re-layout's belief).
SMALL_BELIEVED_FAST = "hex.gpu_catalog.CPU-SMALL.hbm_tb_per_s=3e-05"
MARK = "HEX_E2E_RUN"
TOKEN = "e2e-token-0123456789abcdef"
# For runs whose subject is not a lost server: a stand-in starved of CPU on a loaded 2-core machine can leave a
# health probe unanswered for seconds, and two such probes would relaunch a server that was only slow.
PATIENT_PROBES = ("++hex.elastic.health_timeout_s=20",)
RELAY_CHUNK_BYTES = yaml.safe_load(RECIPE.read_text())["hex"]["relay"]["chunk_mb"] << 20


@dataclass
class Run:
    folder: Path
    returncode: int
    seconds: float
    log: str
    mark: str
    plan: dict = field(default_factory=dict)

    @property
    def trial(self) -> Path:
        (config,) = self.folder.glob("exp/logs/*/*/trial0/config.yaml")
        return config.parent

    def server_logs(self) -> dict[str, list[dict]]:
        """Each server's records (loads and generations), by ``<pool>-<port>``."""
        return {
            path.stem: [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted((self.folder / "servers").glob("*.jsonl"))
        }

    def trainer_weights(self) -> dict[str, torch.Tensor]:
        """The trainer's latest weights: upstream's recover checkpoint (DCP), written after every step."""
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        (dcp_dir,) = self.folder.glob("exp/checkpoints/*/*/trial0/default/recover_checkpoint")
        out = self.folder / "trainer_latest.pt"
        dcp_to_torch_save(dcp_dir, out)
        return torch.load(out, weights_only=True)["dcp"]["model"]

    def relay_digests(self) -> dict[int, tuple[int, str, str]]:
        """Version -> (parts, digest, nonce) of every weight update the trainer sent, as its controller logged
        them."""
        pattern = r"weights v(\d+): .*; (\d+) parts, digest ([0-9a-f]{64}), update ([0-9a-f]{64})\)"
        return {
            int(v): (int(parts), digest, update) for v, parts, digest, update in re.findall(pattern, self.log)
        }

    def server_weights(self, server: str, version: str) -> dict[str, torch.Tensor]:
        """The weights a server served after loading ``version`` (the copy it saved)."""
        from safetensors.torch import load_file

        return load_file(str(self.folder / "servers" / f"{server}.v{version}.safetensors"))

    def wandb_history(self) -> list[dict]:
        (run_file,) = self.folder.glob("exp/logs/*/*/trial0/wandb/offline-run-*/run-*.wandb")
        return history(run_file)

    def shares_per_pool(self) -> dict[str, float]:
        """Each pool's share of the samples as the run ended: the last change the live run recorded (its shares
        by server, named ``host/rank``; a re-plan's are by replica group), else the plan's."""
        changes = self.plan.get("changes", [])
        live = [
            c["shares"] for c in changes if c.get("shares") and c["kind"] not in ("replan", "auto_replan")
        ]
        if not live:
            return {g["pool"]: g["share"] for g in self.plan["rollout"]["replicas"]}
        pool_of = {m["host"]: m["pool"] for m in self.plan["machines"]}
        out: dict[str, float] = {}
        for name, share in live[-1].items():
            pool = pool_of[name.rsplit("/", 1)[0]]
            out[pool] = round(out.get(pool, 0.0) + share, 4)
        return out

    def per_pool(self, event: str, keep) -> Counter:
        """How many records of ``event`` that ``keep`` accepts each pool's servers logged."""
        done: Counter = Counter()
        for name, records in self.server_logs().items():
            done[name.rsplit("-", 1)[0]] += sum(1 for r in records if r["event"] == event and keep(r))
        return done

    def requests_per_pool(self) -> Counter:
        """Requests each pool's servers were sent (the rest of an aborted one, which upstream resubmits to the
        same server, is not a new request)."""
        return self.per_pool("request", lambda r: not r["resumed"])

    def finished_per_pool(self) -> Counter:
        """Sequences each pool's servers finished (aborted pieces that upstream resumed count once)."""
        return self.per_pool("generate", lambda r: r["finish"] != "abort")


def environment(folder: Path, mark: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("RAY_", "WANDB_", "HEX_", "AREAL_")) and key != "PYTHONPATH"
    }
    env.update(
        {
            MARK: mark,
            "PYTHONPATH": f"{REPO}{os.pathsep}{folder / 'sglang-metadata'}",
            "HOME": str(folder / "home"),
            "WANDB_MODE": "offline",
            "WANDB_DIR": str(folder / "wandb"),
            "AREAL_HEX_TRANSPORT_TOKEN": TOKEN,
            LOG_DIR_ENV: str(folder / "servers"),
            # Upstream torch.compiles its log-prob gather; on CPU each trainer rank compiles it again in every run
            # (inductor's C++ backend): 14% of a 4-step run's CPU, for a path no GPU run takes. Eager here.
            "TORCHDYNAMO_DISABLE": "1",
        }
    )
    env.update(extra or {})
    return env


def overrides(folder: Path, scheduler: str, steps: int) -> list[str]:
    return [
        f"scheduler.type={scheduler}",
        f"total_train_steps={steps}",
        f"actor.path={folder / 'model'}",
        f"train_dataset.path={folder / 'gsm8k'}",
        f"cluster.fileroot={folder / 'exp'}",
        f"cluster.name_resolve.nfs_record_root={folder / 'name_resolve'}",
        f"hex.relay.stage_dir={folder / 'stage'}",
    ]


def solved_plan(folder: Path, scheduler: str, steps: int) -> dict:
    """The plan the planner solves for the recipe with the run's overrides, as the driver does at start (the
    solve is deterministic: one CP-SAT worker, a fixed seed); its solve time left out."""
    from areal_hex_plugin.planner import plan_recipe
    from areal_hex_plugin.specs.recipe import load_recipe

    plan = plan_recipe(load_recipe(RECIPE, overrides(folder, scheduler, steps), base_dir=REPO)).to_dict()
    plan["solver"].pop("solve_time_s")
    return plan


def run_driver(
    folder: Path,
    scheduler: str,
    steps: int,
    env: dict[str, str],
    timeout_s: float,
    extra: tuple[str, ...] = (),
    recipe: Path = RECIPE,
    cwd: Path = REPO,
    program: tuple[str, ...] = ("-m", "areal_hex_plugin.driver"),
) -> Run:
    """Make the assets in ``folder`` and run the driver (or another ``program`` that takes ``--config``) on
    ``recipe`` there for ``steps`` steps, from ``cwd``; a run past ``timeout_s`` is killed whole."""
    write_assets(folder)
    for name in ("name_resolve", "home", "wandb"):
        (folder / name).mkdir(exist_ok=True)
    cmd = [
        sys.executable,
        *program,
        "--config",
        str(recipe),
        *overrides(folder, scheduler, steps),
        # Each run its own seed: upstream seeds Python's random with it and draws its workers' ports from that, so
        # two runs with one seed at once (pytest-xdist, a shared machine) try the same ports.
        f"seed={int(env[MARK][:6], 16)}",
        *extra,
    ]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        log += f"\n[e2e] killed after {timeout_s:.0f}s\n"
        kill_marked(env[MARK])  # workers run in sessions of their own
    except BaseException:  # an interrupted test leaves no run behind either
        os.killpg(proc.pid, signal.SIGKILL)
        kill_marked(env[MARK])
        raise
    (folder / "driver.log").write_text(log)
    run = Run(folder, proc.returncode, time.monotonic() - start, log, env[MARK])
    plans = list(folder.glob("exp/logs/*/*/trial0/hex_plan.json"))
    if plans:
        run.plan = json.loads(plans[0].read_text())
    return run


def new_mark() -> str:
    return uuid.uuid4().hex


def kill_marked(mark: str) -> None:
    for entry in processes_with(mark):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(entry.split()[0]), signal.SIGKILL)


def processes_left(mark: str, wait_s: float, named: tuple[str, ...] = ()) -> list[str]:
    """The processes still marked (those whose command line names one of ``named``, if given) after up to
    ``wait_s`` seconds: a stopped process takes a moment to go, a killed Ray actor a few."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [p for p in processes_with(mark) if not named or any(n in p for n in named)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(1)


def processes_with(mark: str) -> list[str]:
    """``pid cmdline`` of every live process whose environment carries ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name} {cmdline[:200]}")
        except OSError:
            continue
    return found
