"""GRPO end to end on CPU: ``python -m areal_hex_plugin.driver --config recipes/ci/tiny.yaml`` runs 3 steps of
upstream's loop under hex_local and under hex_ray (a local Ray cluster with fake GPU nodes).

Upstream's FSDP PPO actor trains on 2 gloo ranks, upstream's RLVR workflow scores with upstream's GSM8K reward,
every weight update goes through the relay transport over TCP into the rollout servers (the SGLang stand-in,
the one stand-in in the loop), two replica groups on two fake GPU types take the plan's shares, and wandb logs
offline. Both runs follow a plan laid out by hand (``hex.plan_path``, ``run.two_layout_plan``): a tp1 server on
CPU-BIG, one tp2 server on CPU-SMALL's two GPUs. Each run is checked for: the plan run is the plan given, each
server started with its group's layout, GPUs and flags, every step done, every server on the trainer's version
with the trainer's weights after every update (by the relay's digest of what the trainer sent), planned shares
within 5%, staleness within the bound, ``hex/*`` in every logged step, and no process left.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("areal")

from tests.e2e.run import (
    MARK,
    RELAY_CHUNK_BYTES,
    STEPS,
    TOKEN,
    Run,
    environment,
    new_mark,
    processes_left,
    run_driver,
    two_layout_plan,
)  # noqa: E402
from tests.e2e.sglang_server import LOG_DIR_ENV, weights_digest  # noqa: E402
from tests.transport.harness import relay_digest  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT_S = 600
SHARE_TOLERANCE = 0.05
# The recipe's pools: 3 machines of 1 CPU-BIG, 1 machine of 2 CPU-SMALL.
CPU_GPUS = {"CPU-BIG": (3, 1), "CPU-SMALL": (1, 2)}  # type: (machines, GPUs per machine)
# What every server's GPU type gets (sglang_flags.py): no FA3 on these types, and the recipe's memory fraction.
TYPE_FLAGS = {"attention_backend": "flashinfer", "mem_fraction_static": 0.8}


def _digest(folder: Path) -> str:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return weights_digest(tensors.items())


def check_run(run: Run, plan_file: Path, leftovers: bool = True) -> dict:
    """Every assertion of the issue on one finished run; returns the figures the report quotes."""
    assert run.returncode == 0, run.log[-6000:]
    # The plan the driver ran is the edited plan it was given, with two layouts (and the changes hex.elastic
    # recorded while it ran: the shares re-balanced for the served lengths).
    given = json.loads(plan_file.read_text())
    assert {**run.plan, "changes": []} == given and {c["kind"] for c in run.plan["changes"]} <= {"drift"}
    assert sorted((g["tp"], g["pp"]) for g in run.plan["rollout"]["replicas"]) == [(1, 1), (2, 1)]
    # After each update every server holds the trainer's version and the trainer's weights: the weights each
    # server then served, under the relay's keyed digest (the token, the update's nonce, the staged buckets'
    # layout, the parts its training ranks sent), give the digest the trainer computed over what it sent. Besides, the trainer's own weights
    # where upstream writes them on CPU: the initial model, and the recover checkpoint of the last step.
    servers = run.server_logs()
    groups = {g["pool"]: g for g in run.plan["rollout"]["replicas"]}
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
    loads = {
        name: [(r["version"], r["digest"]) for r in records if r["event"] == "load"]
        for name, records in servers.items()
    }
    expected_versions = ["default"] + [str(v) for v in range(1, STEPS + 1)]
    for name, seen in loads.items():
        assert [v for v, _ in seen] == expected_versions, (name, seen)
    sent = run.relay_digests()
    assert sorted(sent) == list(range(1, STEPS + 1)), sent
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
    for name, records in servers.items():
        # It generated with the weights it was last given: each generation names the version it ran on.
        used = {r["version"] for r in records if r["event"] == "generate"}
        assert used <= set(expected_versions), name
    versions = {name: [v for v, _ in seen] for name, seen in loads.items()}

    # Each replica group received its planned share of the requests, within 5% over the run. (A group that
    # decodes slower than planned finishes fewer by the end; that is reported, not asserted.)
    sent = run.requests_per_pool()
    total = sum(sent.values())
    share_error = {pool: sent[pool] / total - groups[pool]["share"] for pool in groups}
    assert all(abs(e) <= SHARE_TOLERANCE for e in share_error.values()), (share_error, sent)
    done = run.finished_per_pool()

    # No batch mixes versions beyond the staleness bound, and hex/* is in every step's wandb row.
    eta = run.plan["staleness"]["max_head_offpolicyness"]
    rows = [row for row in run.wandb_history() if any(k.startswith("hex/measured/") for k in row)]
    assert len(rows) == STEPS, [sorted(r) for r in run.wandb_history()]
    staleness = []
    for row in rows:
        assert any(k.startswith("hex/predicted/") for k in row) and "hex/measured/tokens_per_s" in row
        stale = [v for k, v in row.items() if k.endswith("version_stats/sample_staleness_theta_max")]
        assert stale, sorted(row)
        staleness.append(max(stale))
    assert max(staleness) <= eta, (staleness, eta)

    if leftovers:
        assert processes_left(run.mark, wait_s=30) == []
    return {
        "seconds": round(run.seconds, 1),
        "steps": len(rows),
        "versions": versions,
        "share_error": {pool: round(e, 4) for pool, e in share_error.items()},
        "requests": dict(sent),
        "finished": dict(done),
        "staleness_max": staleness,
    }


def _report(run: Run, scheduler: str, figures: dict) -> None:
    print(f"\n[e2e] {scheduler}: {json.dumps(figures)}")


def test_grpo_under_hex_local(tmp_path: Path) -> None:
    gpus = ",".join(f"{gpu_type}:{m * g}" for gpu_type, (m, g) in CPU_GPUS.items())
    env = environment(tmp_path, new_mark(), {"HEX_LOCAL_GPUS": gpus})
    plan_file = two_layout_plan(tmp_path, "hex_local")
    run = run_driver(tmp_path, "hex_local", env, TIMEOUT_S, (f"hex.plan_path={plan_file}",))
    _report(run, "hex_local", check_run(run, plan_file))


def test_grpo_under_hex_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from tests.e2e.run import REPO

    mark = new_mark()
    # Ray's daemons start the workers, which inherit their environment, not the driver's: the run's mark (to
    # find leftovers), the transport's shared secret (exported on every machine, as the README says), the
    # repository (for the stand-in's module) and where the stand-in logs go into it.
    monkeypatch.setenv(MARK, mark)
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN)
    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "servers"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cluster = Cluster(initialize_head=True, head_node_args=_ray_node("CPU-BIG"))
    try:
        for gpu_type, (machines, _) in CPU_GPUS.items():
            for _ in range(machines - (gpu_type == "CPU-BIG")):  # one machine per node, as the pools say
                cluster.add_node(**_ray_node(gpu_type))
        cluster.wait_for_nodes()
        env = environment(tmp_path, mark, {"RAY_ADDRESS": cluster.address})
        plan_file = two_layout_plan(tmp_path, "hex_ray")
        run = run_driver(tmp_path, "hex_ray", env, TIMEOUT_S, (f"hex.plan_path={plan_file}",))
        figures = check_run(run, plan_file, leftovers=False)
        # Every worker of the run (Ray actor) and every server is gone; only Ray's own daemons and idle worker
        # pool (all carrying the mark) stay until the cluster shuts down.
        workers = ("RayRPCServer", "sglang_server", "rpc_server")
        assert processes_left(mark, wait_s=30, named=workers) == []
    finally:
        cluster.shutdown()
    assert processes_left(mark, wait_s=30) == []
    _report(run, "hex_ray", figures)


def _ray_node(gpu_type: str) -> dict:
    return {
        "num_cpus": 4,
        "num_gpus": CPU_GPUS[gpu_type][1],
        "resources": {f"accelerator_type:{gpu_type}": 1},
    }
