"""The relay in upstream's weight-transport registry (patches/0003, 0004 applied to a copy of areal 1.0.4): its
build_meta starts the rollout engines' receivers (upstream's engine RPC made in process) and routes by the plan's
placement; a real 2-rank upstream FSDPPPOActor (gloo, no plugin subclass) with ``weight_update_mode: hex_relay``
finds the relay through the plugin's entry point, every rank sends its share, and both SGLang stand-ins (TP 2)
commit the version bit-exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("areal")

from tests.transport.harness import TOKEN  # noqa: E402
from tests.transport.test_fsdp_actor import (  # noqa: E402
    _free_port,
    _save_model,
    assert_server_holds,
    serving_engine,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


class _EngineCalls:
    """Upstream's engine RPC in process (the scheduler's ``async_call_engine``): each call goes to the engine."""

    def __init__(self, engines: dict) -> None:
        self.engines = engines

    async def async_call_engine(self, worker_id, method, engine_name=None, **kwargs):
        return getattr(self.engines[worker_id], method)(**kwargs)


def _trainer(tmp_path: Path, engines: list) -> SimpleNamespace:
    """What build_meta reads of upstream's PPOTrainer: the config (HexGRPOConfig of the CI recipe), the Hex
    scheduler's placement (the planner's plan for it), the rollout controller's workers and the train
    controller's."""
    from areal.api.cli_args import load_expr_config

    from areal_hex_plugin.areal.config import HexGRPOConfig
    from areal_hex_plugin.areal.session import session_for

    (tmp_path / "nr").mkdir()
    config, _ = load_expr_config(
        ["--config", str(REPO / "recipes/ci/tiny.yaml"), f"cluster.fileroot={tmp_path}",
         f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}", f"hex.relay.stage_dir={tmp_path / 'stage'}"],
        HexGRPOConfig,
    )  # fmt: skip
    placement = session_for(config, "test").placement
    assert len(placement.slots["rollout"]) == len(engines)
    workers = [SimpleNamespace(id=f"rollout/{i}") for i in range(len(engines))]
    rollout = SimpleNamespace(
        workers=workers,
        scheduler=_EngineCalls({w.id: e for w, e in zip(workers, engines, strict=True)}),
        _engine_name=lambda rank: f"rollout/{rank}",
    )
    from areal.utils.network import gethostip

    # The train controller's workers: rank 0's host is the one whose control channels the receivers take.
    actor = SimpleNamespace(workers=[SimpleNamespace(id="actor/0", ip=gethostip())])
    return SimpleNamespace(
        config=config, scheduler=SimpleNamespace(placement=placement), rollout=rollout, actor=actor
    )


def test_upstream_fsdp_actor_runs_the_relay_from_the_registry(tmp_path: Path, monkeypatch) -> None:
    from areal_hex_plugin.areal.transport_setup import relay_weight_transport

    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    monkeypatch.chdir(REPO)  # the recipe's model shape is a path relative to the repository
    sys.path.insert(0, str(REPO / "patches"))
    import check_patches

    areal_root = tmp_path / "areal-patched"
    areal_root.mkdir()
    assert all(ok for _, ok, _ in check_patches.apply_all(areal_root))
    expected = _save_model(tmp_path / "model")
    replicas = [serving_engine() for _ in range(2)]  # the planner's two rollout servers
    try:
        # The trainer's side: the receivers start and the route is made from the plan's placement.
        # (build_meta wraps these in the patched WeightUpdateMeta, which this unpatched process lacks.)
        options = relay_weight_transport().meta_options(_trainer(tmp_path, [e for _, e in replicas]))
        assert options["replicas"] == 2
        port = _free_port()
        env = {
            "PYTHONPATH": f"{areal_root}:{REPO}",
            "HOME": str(tmp_path),
            "PATH": "/usr/bin:/bin",
            "AREAL_HEX_TRANSPORT_TOKEN": TOKEN.decode(),
        }
        code = (
            "from tests.transport.fsdp_rank import run_registry_rank as run; run({}, 2, {}, {!r}, {!r}, {!r})"
        )
        address = replicas[0][0].address  # the rollout engine each rank pauses and resumes
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", code.format(rank, port, str(tmp_path / "model"), address, options)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(2)
        ]
        try:
            logs = [rank.communicate(timeout=300)[0] for rank in ranks]
            assert [rank.returncode for rank in ranks] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
        finally:
            for rank in ranks:
                rank.kill()
    finally:
        for server, engine in replicas:
            engine.hex_stop_receiver()
            engine.destroy()
            server.close()
    assert "Loading plugin hex" in "".join(logs)  # found through the entry point, in the workers
    assert (
        "weights v3: " in logs[0] and "to 2/2 replicas" in logs[0] and "2 parts" in logs[0]
    )  # rank 0 checked
    for server, engine in replicas:
        assert engine.get_version() == 3
        assert_server_holds(server, expected)
