"""Per-pool rollout layouts through upstream's real RolloutController: each server starts with its own GPUs,
TP/PP, planned concurrency and GPU-type flags; upstream's xccl path is refused with mixed layouts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.areal.config import load_hex_config  # noqa: E402
from areal_hex_plugin.areal.engines import HexRolloutController  # noqa: E402
from areal_hex_plugin.areal.rewrite import apply_plan  # noqa: E402
from areal_hex_plugin.areal.schedulers.local import HexLocalScheduler  # noqa: E402
from areal_hex_plugin.areal.worker_slots import node_local  # noqa: E402
from areal_hex_plugin.errors import UpstreamLimit  # noqa: E402
from tests.integration.plans import two_type_plan  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes/paper/7b.yaml"
UPSTREAM_ARGS = {"model_path": "m", "tp_size": 1, "attention_backend": "fa3", "mem_fraction_static": 0.9}


def _config(tmp_path: Path, *overrides: str):
    (tmp_path / "nr").mkdir(exist_ok=True)
    paths = [f"cluster.fileroot={tmp_path}", f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}"]
    config, _ = load_hex_config(["--config", str(RECIPE), *paths, *overrides])
    return config


@pytest.mark.integration
@pytest.mark.slow
def test_each_server_starts_with_its_groups_layout_and_flags(tmp_path: Path) -> None:
    plan = two_type_plan(servers_per_machine=1, big_tp=2)  # 1 H100 server tp2 + 2 L40S servers tp1
    config = _config(tmp_path, "sglang.mem_fraction_static=0.88")  # the rewrite caps it per GPU type
    rewrite = apply_plan(config, plan)
    assert config.rollout.backend == "sglang:d3p1t1"
    assert any("2 layouts (tp1 pp1, tp2 pp1)" in note for note in rewrite.notes)
    spec = config.rollout.scheduling_spec[0]
    spec.cpu, spec.mem, spec.cmd = 1, 1, "python -m areal.infra.rpc.rpc_server"
    spec.env_vars = {"PYTHONPATH": str(REPO)}
    scheduler = HexLocalScheduler(
        node_local(rewrite.placement, plan),
        log_dir=str(tmp_path / "logs"),
        startup_timeout=180,
        experiment_name="hex-test",
        trial_name="layouts",
        fileroot=str(tmp_path),
        nfs_record_root=str(tmp_path / "nr"),
    )
    from tests.integration.probe_engine import LaunchProbe

    controller = HexRolloutController(LaunchProbe, config=config.rollout, scheduler=scheduler)
    try:
        controller.initialize(role="rollout", server_args=dict(UPSTREAM_ARGS))

        async def reports() -> list[dict]:
            calls = (
                scheduler.async_call_engine(w.id, "launched", engine_name=f"rollout/{i}")
                for i, w in enumerate(controller.workers)
            )
            return await asyncio.gather(*calls)

        got = asyncio.run(reports())
    finally:
        controller.destroy()
    seen = [
        (
            r["env"]["HEX_GPU_TYPE"],
            r["env"]["HEX_GPU_IDS"],
            r["server_args"]["tp_size"],
            r["server_args"].get("pp_size"),
            r["server_args"]["max_running_requests"],
            r["server_args"]["attention_backend"],
            r["server_args"]["mem_fraction_static"],
        )
        for r in got
    ]
    assert seen == [
        ("H100", "2 3", 2, None, 128, "fa3", 0.88),
        ("L40S", "4", 1, None, 32, "flashinfer", 0.85),
        ("L40S", "6", 1, None, 32, "flashinfer", 0.85),
    ]
    assert all(r["server_args"]["model_path"] == "m" for r in got)  # upstream's other args pass through


@pytest.mark.integration
def test_upstream_xccl_with_mixed_layouts_is_refused_before_anything_starts(tmp_path: Path) -> None:
    config = _config(tmp_path, "hex.transport=upstream")
    with pytest.raises(UpstreamLimit, match="xccl weight update gives server i rank offset") as err:
        apply_plan(config, two_type_plan(big_tp=2))
    assert "hex.transport=relay" in err.value.problem
    # One layout for every server is fine on xccl, and so are mixed layouts over the relay.
    apply_plan(_config(tmp_path, "hex.transport=upstream"), two_type_plan())
    apply_plan(_config(tmp_path), two_type_plan(big_tp=2))


@pytest.mark.integration
def test_every_change_to_the_recipe_is_explained(tmp_path: Path) -> None:
    from areal_hex_plugin.areal.startup import placement_table

    config = _config(tmp_path, "sglang.max_running_requests=300")
    rewrite = apply_plan(config, two_type_plan(big_tp=2))
    notes = "\n".join(rewrite.notes)
    # The dry run's placement shows each replica group with its own layout and planned concurrency.
    table = placement_table(rewrite)
    assert "1 servers x tp2 pp1, share 50.0%, max_running_requests=128 attn=fa3" in table
    assert "4 servers x tp1 pp1, share 50.0%, max_running_requests=32 attn=flashinfer" in table
    for change in (
        "actor.backend: fsdp:d8 -> fsdp:d2t1: the plan trains on 2 GPUs",
        "rollout.backend: sglang:d8p1t1 -> sglang:d5p1t1: the plan runs 5 rollout servers",
        "rollout.max_concurrent_rollouts: 512 -> 192: the planned servers decode 256 sequences",
        "sglang.max_running_requests: 300 -> each server's planned concurrency",
    ):
        assert change in notes
    # The rewrite runs again inside HexPPOTrainer: the config already follows the plan; only what each server
    # overrides at launch is still explained.
    again = apply_plan(config, two_type_plan(big_tp=2)).notes
    assert [n.split(":")[0] for n in again] == ["rollout", "sglang.max_running_requests"]


@pytest.mark.integration
def test_a_rollout_backend_the_plugin_cannot_start_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UpstreamLimit, match="is vllm") as err:
        apply_plan(_config(tmp_path, "rollout.backend=vllm:d8p1t1"), two_type_plan())
    assert err.value.field == "rollout.backend"
