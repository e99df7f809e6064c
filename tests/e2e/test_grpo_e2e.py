"""GRPO end to end on CPU: ``python -m areal_hex_plugin.driver --config recipes/ci/tiny.yaml`` runs upstream's loop
under hex_local (20 steps: the policy learns the recipe's task) and under hex_ray (4 steps, a local Ray cluster
with fake GPU nodes).

Upstream's FSDP PPO actor trains on 2 gloo ranks, upstream's RLVR workflow scores with the recipe's reward (1 when
the first token is a target token, ``tests/e2e/target_reward.py``), every weight update goes through the relay
transport over TCP into the rollout servers (the SGLang stand-in, the one stand-in in the loop), and wandb logs
offline. The driver solves the plan at start, as a user's run does. Each run is checked for:

- the plan run is the planner's own for the recipe: two replica groups with two layouts (tp1 on CPU-BIG, tp2 on
  CPU-SMALL) whose shares are far from even (3/4, 1/4), an update window of 2 under eta = 1;
- each server started with its group's layout, GPUs and flags; every step done;
- weights pushed every window only: each server loaded exactly the window's versions, and after each the
  trainer's weights (by the relay's digest of what the trainer sent); each finished generation ran on the version
  its server held; every version but the last generated samples;
- each group received its planned share of the requests within ``SHARE_BAND`` (a round-robin split misses it);
- upstream's logged staleness: every sample of a step whose version was not pushed is behind the policy by that
  many versions, none beyond eta, and some step trained off-policy;
- a non-zero gradient at every step (no weight decay: the gradient alone moves the weights), unless every sample
  of the step earned the same reward, all or none (GRPO has no advantage to follow then);
  ``hex/*`` in every logged step; no process left;
- the online refit's ``hex/calibration/*`` and ``hex/replan/*`` at the step after each refit, every refit
  fitted with each type's factors (the stand-ins decode at the true catalog's speed, ``HEX_STANDIN_TRUTH`` =
  ``tests/e2e/truth.yaml``), and its ``hex_profile.json`` beside the plan.

The hex_local run also learns (``target_reward.learning``): the mean reward of its last 4 steps reaches 0.45 from the
initial policy's 0.25, which a policy no better than the initial one reaches with probability below 1e-6 (the
binomial tail from the initial model's exact probabilities), and the trained policy's exact expected reward does
too.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.areal.refit_loop import PROFILE_FILE  # noqa: E402
from areal_hex_plugin.costmodel.calibration import RANGES, read_profile  # noqa: E402
from tests.e2e.run import (  # noqa: E402
    MARK,
    PATIENT_PROBES,
    RELAY_CHUNK_BYTES,
    TOKEN,
    TRUTH,
    Run,
    environment,
    new_mark,
    processes_left,
    run_driver,
    solved_plan,
)
from tests.e2e.sglang_server import LOG_DIR_ENV, TRUTH_ENV, weights_digest  # noqa: E402
from tests.e2e.target_reward import (  # noqa: E402
    CHANCE,
    LEARN_STEPS,
    LEARNED,
    TASK_REWARD,
    learning,
    prompt_ids,
    target_probability,
)
from tests.transport.harness import relay_digest  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT_S = 600
RAY_STEPS = 4
# Requests are routed by smooth weighted round-robin, each group within one request of its share over any stretch
# of requests, so over a run's hundreds of requests the measured share is within 0.01 of the planned one. The band
# is 0.05; the planned shares are at least 0.2 from an even split (asserted), so round-robin (0.5) misses the band
# by 0.15 or more.
SHARE_BAND = 0.05
UNEVEN = 0.2
# The recipe's pools: 3 machines of 1 CPU-BIG, 1 machine of 2 CPU-SMALL.
CPU_GPUS = {"CPU-BIG": (3, 1), "CPU-SMALL": (1, 2)}  # type: (machines, GPUs per machine)
# What every server's GPU type gets (sglang_flags.py): no FA3 on these types, and the recipe's memory fraction.
TYPE_FLAGS = {"attention_backend": "flashinfer", "mem_fraction_static": 0.8}
# Upstream's stats (areal 1.0.4 PPOActor), as its StatsLogger commits them to wandb.
STALENESS_MAX = "ppo_actor/update/version_stats/sample_staleness_theta_max"
STALENESS_MIN = "ppo_actor/update/version_stats/sample_staleness_theta_min"
GRAD_NORM = "ppo_actor/update/grad_norm"
# hex.calibration.refit_every's default: a refit at steps 5, 10, ..., its figures logged with the next step.
REFIT_EVERY = 5
# A refit of a run whose servers decode at the true catalog's speed misses its measurements by at most this (rms
# log error; the loop keeps the running model above ln 2): the CPU's train step and update wander a little.
FITTED = 0.35


def _digest(folder: Path) -> str:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return weights_digest(tensors.items())


def _served_versions(records: list[dict]) -> set[str]:
    """The versions a server's finished generations ran on, each checked to be the one it held then."""
    held, used = None, set()
    for r in records:
        if r["event"] == "load":
            held = r["version"]
        elif r["event"] == "generate" and r["finish"] != "abort":
            assert r["version"] == held, (r, held)
            used.add(r["version"])
    return used


def check_run(run: Run, scheduler: str, steps: int, leftovers: bool = True) -> dict:
    """Every assertion of the module docstring on one finished run; returns the figures the report quotes."""
    assert run.returncode == 0, run.log[-6000:]
    # The plan the driver ran is the one the planner solves for the recipe (and the changes hex.elastic recorded
    # while it ran, if any: shares re-balanced for the served lengths).
    ran = json.loads(json.dumps(run.plan))
    ran["solver"].pop("solve_time_s")
    assert {c["kind"] for c in ran.pop("changes", [])} <= {"drift"}, run.plan["changes"]
    solved = solved_plan(run.folder, scheduler, steps)
    solved.pop("changes", None)
    assert ran == solved
    groups = {g["pool"]: g for g in run.plan["rollout"]["replicas"]}
    assert sorted((g["tp"], g["pp"]) for g in groups.values()) == [(1, 1), (2, 1)]
    assert all(abs(g["share"] - 0.5) >= UNEVEN for g in groups.values()), groups
    window = run.plan["solver"]["window_steps"]
    eta = run.plan["staleness"]["max_head_offpolicyness"]
    assert window > 1 and eta >= 1 and steps % window == 0, (window, eta, steps)

    servers = run.server_logs()
    assert sorted({name.rsplit("-", 1)[0] for name in servers}) == sorted(groups)
    assert len(servers) == sum(g["count"] for g in groups.values())
    for name, records in servers.items():
        group = groups[name.rsplit("-", 1)[0]]
        (start,) = [r for r in records if r["event"] == "start"]
        assert start["tp_size"] == group["tp"] and start["pp_size"] == group["pp"], (name, start)
        assert start["max_running_requests"] == group["concurrency"], (name, start)
        assert {k: start[k] for k in TYPE_FLAGS} == TYPE_FLAGS, (name, start)
        assert len(start["planned_gpu_ids"].split()) == group["tp"] * group["pp"], (name, start)
        if start["visible_devices"] is not None:  # Ray's GPU ids for the worker
            assert len(start["visible_devices"].split(",")) == group["tp"] * group["pp"], (name, start)

    # Weights go out every window steps only, and each push leaves every server with the trainer's weights: the
    # weights each server then served, under the relay's keyed digest (the token, the update's nonce, the staged
    # buckets' layout, the parts its training ranks sent), give the digest the trainer computed over what it sent.
    # Besides, the trainer's own weights where upstream writes them on CPU: the initial model, and the recover
    # checkpoint of the last step.
    pushed = list(range(window, steps + 1, window))
    sent = run.relay_digests()
    assert sorted(sent) == pushed, sent
    loads = {
        name: [(r["version"], r["digest"]) for r in records if r["event"] == "load"]
        for name, records in servers.items()
    }
    for name, seen in loads.items():
        assert [v for v, _ in seen] == ["default"] + [str(v) for v in pushed], (name, seen)
    for name, records in servers.items():
        for load in [r for r in records if r["event"] == "load" and r["version"] != "default"]:
            version = int(load["version"])
            parts, digest, update = sent[version]
            served = run.server_weights(name, load["version"])
            token = TOKEN.encode()
            recomputed = relay_digest(
                served, load["buckets"], parts, version, update, token, RELAY_CHUNK_BYTES
            )
            assert recomputed == digest, (name, version)
    digests = {tuple(d for _, d in seen) for seen in loads.values()}
    assert len(digests) == 1, loads  # every server got the same weights for every version
    (chain,) = digests
    assert len(set(chain)) == len(chain)  # every update changed the weights
    assert chain[0] == _digest(run.folder / "model")
    assert chain[-1] == weights_digest(run.trainer_weights().items())
    # Each version but the last (pushed after the last step) generated samples on every server, each finished
    # generation on the version its server held.
    versions = [v for v, _ in next(iter(loads.values()))]
    for name, records in servers.items():
        used = _served_versions(records)
        assert set(versions[:-1]) <= used <= set(versions), (name, used)

    # Each replica group received its planned share of the requests. (A group that decodes slower than planned
    # finishes fewer by the end; that is reported, not asserted.)
    requests = run.requests_per_pool()
    total = sum(requests.values())
    share_error = {pool: requests[pool] / total - groups[pool]["share"] for pool in groups}
    assert all(abs(e) <= SHARE_BAND for e in share_error.values()), (share_error, requests)

    # Upstream's staleness stats: at step s the policy is at version s and the servers at the last pushed
    # version, so every sample is at least s mod window versions behind, and none more than eta.
    rows = [row for row in run.wandb_history() if any(k.startswith("hex/measured/") for k in row)]
    assert len(rows) == steps, [sorted(r) for r in run.wandb_history()]
    staleness = []
    for step, row in enumerate(rows):
        assert any(k.startswith("hex/predicted/") for k in row) and "hex/measured/tokens_per_s" in row
        # The train phase as the model prices it: the decoupled loss's log-prob pass, then the update.
        assert row["hex/measured/logp_s"] > 0 and row["hex/predicted/logp_s"] > 0, row
        assert row["hex/measured/train_s"] == pytest.approx(
            row["hex/measured/logp_s"] + row["hex/measured/update_s"]
        )
        low, high = row[STALENESS_MIN], row[STALENESS_MAX]
        assert step % window <= low <= high <= eta, (step, low, high, eta)
        staleness.append((low, high))
        # A step with no gradient is one whose every sample earned the same reward, all or none (GRPO's advantages
        # are all 0 then; none at the initial policy's 1 in 4 over a step's samples is rare, not impossible).
        assert row[GRAD_NORM] > 0 or row[TASK_REWARD] in (0.0, 1.0), (step, row[GRAD_NORM], row[TASK_REWARD])
    assert max(high for _, high in staleness) >= 1, staleness
    refit = check_refit(run, rows)

    if leftovers:
        assert processes_left(run.mark, wait_s=30) == []
    return {
        "seconds": round(run.seconds, 1),
        "steps": len(rows),
        "window": window,
        "eta": eta,
        "versions": versions,
        "planned_shares": {pool: g["share"] for pool, g in groups.items()},
        "share_error": {pool: round(e, 4) for pool, e in share_error.items()},
        "requests": dict(requests),
        "finished": dict(run.finished_per_pool()),
        "staleness_min_max": staleness,
        "grad_norm": [round(row[GRAD_NORM], 4) for row in rows],
        "task_reward": [round(row[TASK_REWARD], 4) for row in rows],
        "refit": refit,
    }


def check_refit(run: Run, rows: list[dict]) -> dict:
    """The online refit (on by default, every REFIT_EVERY steps) ran beside the trainer: each refit's residuals
    against each server's decode speed (read from the stand-in's /metrics), the train step and the update reach
    wandb with the first step committed after it, in well under a CPU second. The stand-ins decode at the true
    catalog's speeds (``TRUTH``, the recipe's own figures here), so every refit fits (``failed`` 0, rms log error
    within ``FITTED``, every factor inside its range), logs each type's factors and its re-plan decision and
    writes a hex_profile.json beside the plan that reads back as a profile."""
    refits = [k for k, row in enumerate(rows) if "hex/calibration/rms_log_error" in row]
    assert len(refits) == len(range(REFIT_EVERY, len(rows), REFIT_EVERY)), [sorted(r) for r in rows]
    assert all(k >= REFIT_EVERY * (i + 1) for i, k in enumerate(refits)), refits
    if not refits:
        return {}
    factors = {f"hex/calibration/{t}/{f}": f for t in CPU_GPUS for f in ("hbm_fraction", "infer_mfu")}
    factors["hex/calibration/CPU-BIG/train_mfu"] = "train_mfu"
    for k in refits:
        row = rows[k]
        assert 0 < row["hex/calibration/cpu_s"] < 1.0, row
        assert {
            "hex/calibration/residual/rollout_tokens_per_s/big_tp1pp1",
            "hex/calibration/residual/rollout_tokens_per_s/small_tp2pp1",
            "hex/calibration/residual/train_s/CPU-BIG",
            "hex/replan/suggested",
            "hex/replan/tokens_per_s_after",
            *factors,
        } <= set(row), sorted(row)
        assert row["hex/calibration/failed"] == 0.0 and row["hex/calibration/rms_log_error"] <= FITTED, row
        for key, factor in factors.items():
            assert RANGES[factor].low <= row[key] <= RANGES[factor].high, (key, row[key])
    assert set(read_profile(run.trial / PROFILE_FILE)) == set(CPU_GPUS)
    # Each server's step figures as read from its /metrics: decode speed, the decode iteration it implies and
    # the KV pool's used fraction (the stand-in's cache per request: a small fraction, never 0 while busy).
    for rank in (0, 1):
        busy = [row for row in rows if f"hex/server/{rank}/tokens_per_s" in row]
        assert busy, [sorted(r) for r in rows]
        for row in busy:
            figures = {k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith(f"hex/server/{rank}/")}
            assert figures["decode_iteration_s"] == pytest.approx(
                figures["running"] / figures["tokens_per_s"]
            )
            assert 0 < figures["kv_usage"] < 1, figures
    step_s = [row["hex/measured/step_s"] for row in rows]
    last = rows[refits[-1]]
    return {
        "refits_logged_at": [k + 1 for k in refits],
        "factors_last": {k.split("/", 2)[2]: round(rows[refits[-1]][k], 4) for k in factors},
        "replan_suggested": [rows[k]["hex/replan/suggested"] for k in refits],
        "residuals_last": {
            k: round(v, 3) for k, v in last.items() if k.startswith("hex/calibration/residual/")
        },
        "rms_log_error_last": last["hex/calibration/rms_log_error"],
        "cpu_s_max": max(rows[k]["hex/calibration/cpu_s"] for k in refits),
        "median_step_s_before_after_first_refit": [
            statistics.median(step_s[1 : refits[0]]),
            statistics.median(step_s[refits[0] :]),
        ],
    }


def check_learning(run: Run) -> dict:
    """The task reward climbs (``target_reward.learning``): the last steps' mean reaches LEARNED, beyond what
    chance gives the initial policy, and so does the trained policy's exact expected reward."""
    rows = [row for row in run.wandb_history() if any(k.startswith("hex/measured/") for k in row)]
    prompts = prompt_ids(run.folder / "model", run.folder / "gsm8k")
    initial = target_probability(None, run.folder / "model", prompts)
    trained = target_probability(run.trainer_weights(), run.folder / "model", prompts)
    figures = learning(rows, initial, trained)
    assert figures["chance_of_threshold"] < CHANCE, figures
    assert figures["last_mean"] >= LEARNED, figures
    assert figures["trained_expected_reward"] >= LEARNED, figures
    assert figures["passed"], figures
    return figures


def _report(scheduler: str, figures: dict) -> None:
    print(f"\n[e2e] {scheduler}: {json.dumps(figures)}")


def test_grpo_learns_under_hex_local_and_the_same_command_again_ends_at_once(tmp_path: Path) -> None:
    gpus = ",".join(f"{gpu_type}:{m * g}" for gpu_type, (m, g) in CPU_GPUS.items())
    env = environment(tmp_path, new_mark(), {"HEX_LOCAL_GPUS": gpus, TRUTH_ENV: str(TRUTH)})
    run = run_driver(tmp_path, "hex_local", LEARN_STEPS, env, TIMEOUT_S, PATIENT_PROBES)
    figures = check_run(run, "hex_local", LEARN_STEPS)
    figures["learning"] = check_learning(run)
    assert (
        "workers for role 'eval-rollout'" not in run.log
    )  # the recipe never evaluates: no eval-rollout workers
    # The same command again: the pre-flight reads the first run's recover info (every step trained) and the
    # driver ends without starting a worker, leaving nothing.
    again = run_driver(tmp_path, "hex_local", LEARN_STEPS, env, TIMEOUT_S, PATIENT_PROBES)
    assert again.returncode == 0, again.log[-6000:]
    assert f"already trained its {LEARN_STEPS} steps" in again.log and "nothing was started" in again.log
    assert "upstream AReaL starts the workers" not in again.log and processes_left(run.mark, wait_s=30) == []
    figures["again_s"] = round(again.seconds, 1)
    _report("hex_local", figures)


def test_grpo_under_hex_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from tests.e2e.run import REPO

    mark = new_mark()
    # Ray's daemons start the workers, which inherit their environment, not the driver's: the run's mark (to
    # find leftovers), the transport's shared secret (exported on every machine, as the README says), the
    # repository (for the stand-in's and the reward's modules), where the stand-in logs go into it and the true
    # catalog that paces it.
    monkeypatch.setenv(MARK, mark)
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN)
    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "servers"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(TRUTH_ENV, str(TRUTH))
    cluster = Cluster(initialize_head=True, head_node_args=_ray_node("CPU-BIG"))
    try:
        for gpu_type, (machines, _) in CPU_GPUS.items():
            for _ in range(machines - (gpu_type == "CPU-BIG")):  # one machine per node, as the pools say
                cluster.add_node(**_ray_node(gpu_type))
        cluster.wait_for_nodes()
        env = environment(tmp_path, mark, {"RAY_ADDRESS": cluster.address})
        run = run_driver(tmp_path, "hex_ray", RAY_STEPS, env, TIMEOUT_S, PATIENT_PROBES)
        figures = check_run(run, "hex_ray", RAY_STEPS, leftovers=False)
        # Every worker of the run (Ray actor) and every server is gone; only Ray's own daemons and idle worker
        # pool (all carrying the mark) stay until the cluster shuts down.
        workers = ("RayRPCServer", "sglang_server", "rpc_server")
        assert processes_left(mark, wait_s=30, named=workers) == []
    finally:
        cluster.shutdown()
    assert processes_left(mark, wait_s=30) == []
    _report("hex_ray", figures)


def _ray_node(gpu_type: str) -> dict:
    return {
        "num_cpus": 4,
        "num_gpus": CPU_GPUS[gpu_type][1],
        "resources": {f"accelerator_type:{gpu_type}": 1},
    }
