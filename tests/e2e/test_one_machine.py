"""Issue 26, item 1: ONE machine split between the roles, end to end on CPU. The driver plans
``recipes/ci/one_machine.yaml`` itself (one machine of four fake GPUs; no plan laid out by hand), splits it
between upstream's FSDP trainer and the rollout servers (the SGLang stand-in) as upstream runs one node as
``sglang.d2+fsdp.d2``, and runs 3 GRPO steps under hex_local with the relay transport between the two parts.

Checked: the plan run has one machine whose GPUs go to both roles; each server started on its planned GPUs of that
machine, none of them a training GPU; every server loaded every version and served the trainer's weights (the
relay's digest of what the trainer sent, and the recover checkpoint of the last step); every step is logged with
the staleness bound kept; no process is left.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("areal")

from tests.e2e.run import (
    RELAY_CHUNK_BYTES,
    REPO,
    TOKEN,
    environment,
    new_mark,
    processes_left,
    run_driver,
)  # noqa: E402
from tests.e2e.sglang_server import weights_digest  # noqa: E402
from tests.transport.harness import relay_digest  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
RECIPE = REPO / "recipes" / "ci" / "one_machine.yaml"
TIMEOUT_S = 600
STEPS = 3


def test_one_machine_split_between_training_and_rollout(tmp_path: Path) -> None:
    env = environment(tmp_path, new_mark(), {"HEX_LOCAL_GPUS": "CPU-ONE:4"})
    run = run_driver(tmp_path, "hex_local", STEPS, env, TIMEOUT_S, recipe=RECIPE)
    assert run.returncode == 0, run.log[-6000:]

    # The plan: one machine, some GPUs training and the others serving.
    (machine,) = run.plan["machines"]
    assert machine["role"] == "split"
    train_gpus = {g["gpu"] for g in machine["gpus"] if g["role"] == "train"}
    serve_gpus = {g["gpu"] for g in machine["gpus"] if g["role"] == "rollout"}
    assert train_gpus and serve_gpus and not train_gpus & serve_gpus
    groups = run.plan["rollout"]["replicas"]
    assert sum(g["count"] for g in groups) >= 1

    # Each server ran on its planned GPUs of the machine, none of them a training GPU.
    servers = run.server_logs()
    assert len(servers) == sum(g["count"] for g in groups)
    started = set()
    for name, records in servers.items():
        (start,) = [r for r in records if r["event"] == "start"]
        ids = {int(i) for i in start["planned_gpu_ids"].split()}
        assert ids <= serve_gpus and not ids & started, (name, start, serve_gpus)
        started |= ids
    assert started == serve_gpus

    # Every server got every version, with the trainer's weights (the relay's digest over what it served).
    sent = run.relay_digests()
    assert sorted(sent) == list(range(1, STEPS + 1)), sent
    for name, records in servers.items():
        loads = [r for r in records if r["event"] == "load"]
        assert [r["version"] for r in loads] == ["default"] + [str(v) for v in range(1, STEPS + 1)], name
        for load in loads[1:]:
            parts, digest, update = sent[int(load["version"])]
            served = run.server_weights(name, load["version"])
            recomputed = relay_digest(
                served,
                load["buckets"],
                parts,
                int(load["version"]),
                update,
                TOKEN.encode(),
                RELAY_CHUNK_BYTES,
            )
            assert recomputed == digest, (name, load["version"])
        last = loads[-1]["digest"]
        assert last == weights_digest(run.trainer_weights().items()), name

    # Every step logged, within the staleness bound.
    eta = run.plan["staleness"]["max_head_offpolicyness"]
    rows = [row for row in run.wandb_history() if any(k.startswith("hex/measured/") for k in row)]
    assert len(rows) == STEPS
    for row in rows:
        stale = [v for k, v in row.items() if k.endswith("version_stats/sample_staleness_theta_max")]
        assert stale and max(stale) <= eta, row
    assert processes_left(run.mark, wait_s=30) == []
    print(
        f"\n[e2e] one machine: {run.seconds:.0f}s, train GPUs {sorted(train_gpus)}, serve GPUs {sorted(serve_gpus)}"
    )
