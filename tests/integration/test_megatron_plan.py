"""A pipelined plan on Megatron, translated on CPU: stages on different GPU types, each rank in the stage Megatron
will give it, and the planned per-stage layer counts as megatron-core's pipeline layout. The engine side (a
Megatron actor building that layout on GPUs) is checked by tests/gpu/megatron_check.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal.api.alloc_mode import ModelAllocation  # noqa: E402

from areal_hex_plugin.areal.config import load_hex_config  # noqa: E402
from areal_hex_plugin.areal.megatron_layout import layer_stage, planned_layers, stage_layout  # noqa: E402
from areal_hex_plugin.areal.rewrite import apply_plan  # noqa: E402
from areal_hex_plugin.errors import HexError, UpstreamLimit  # noqa: E402
from areal_hex_plugin.plan import GpuAssignment, Machine, TrainPlan, TrainStage  # noqa: E402
from tests.integration.plans import two_type_plan  # noqa: E402

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes/paper/7b.yaml"  # Qwen2-architecture 7B: 28 layers


def _pipelined_plan():
    """big-0 (H100) trains stage 0 with 20 layers, small-0 (L40S) stage 1 with 8; small-1 runs 2 servers."""
    plan = two_type_plan()
    stage = [GpuAssignment(g, "train", stage=1, dp_rank=g, tp_rank=0) for g in (0, 1)]
    servers = [GpuAssignment(g, "rollout", stage=0, tp_rank=0, group=1, instance=g) for g in (0, 1)]
    machines = [
        plan.machines[0],
        plan.machines[1],
        Machine("small", "small-0", "L40S", "train", stage),
        Machine("small", "small-1", "L40S", "rollout", servers),
    ]
    groups = [plan.rollout.replicas[0], replace(plan.rollout.replicas[1], count=2)]
    train = TrainPlan(
        {"H100": 2, "L40S": 2},
        [TrainStage("big", "H100", 2, 1, 20, ["big-0"]), TrainStage("small", "L40S", 2, 1, 8, ["small-0"])],
    )
    return replace(plan, train=train, machines=machines, rollout=replace(plan.rollout, replicas=groups))


def _config(tmp_path: Path, *overrides: str):
    (tmp_path / "nr").mkdir(exist_ok=True)
    paths = [f"cluster.fileroot={tmp_path}", f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}"]
    config, _ = load_hex_config(["--config", str(RECIPE), *paths, *overrides])
    return config


def test_stages_on_two_gpu_types_reach_megatron_in_rank_order_with_their_layers(tmp_path: Path) -> None:
    config = _config(tmp_path, "actor.backend=megatron:d2p2t1", "hex.transport=upstream")
    rewrite = apply_plan(config, _pipelined_plan())
    alloc = ModelAllocation.from_str(config.actor.backend)
    assert (alloc.backend, alloc.parallel.dp_size, alloc.parallel.pp_size, alloc.parallel.tp_size) == (
        "megatron", 2, 2, 1,
    )  # fmt: skip
    slots = rewrite.placement.for_role("actor")
    dp, tp = alloc.parallel.dp_size, alloc.parallel.tp_size
    for rank, slot in enumerate(slots):
        megatron_stage = rank // (dp * tp)  # order "tp-cp-ep-dp-pp", as MegatronEngine initialises it
        assert slot.stage == megatron_stage
        assert slot.gpu_type == ("H100", "L40S")[megatron_stage]
        assert planned_layers(slot.env()) == (20, 8)
    layout = stage_layout(planned_layers(slots[0].env()), pp_size=2, vpp_size=1, num_layers=28)
    assert layout == [["embedding"] + ["decoder"] * 20, ["decoder"] * 8 + ["loss"]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (((20, 8), 2, 2, 28), "virtual pipeline"),
        (((20, 8), 3, 1, 28), "2 stages but the engine runs pp=3"),
        (((20, 9), 2, 1, 28), "do not split the model's 28 layers"),
    ],
)
def test_a_layout_the_engine_disagrees_with_is_refused(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        stage_layout(*args)


def test_fsdp_cannot_run_the_pipelined_plan_and_says_why(tmp_path: Path) -> None:
    with pytest.raises(UpstreamLimit, match="training stages: the plan pipelines training over 2 stages"):
        apply_plan(_config(tmp_path), _pipelined_plan())


def test_relay_with_a_megatron_actor_sends_from_every_stage(tmp_path: Path) -> None:
    from areal_hex_plugin.areal import plugin
    from areal_hex_plugin.areal.rewrite import uses_relay

    config = _config(tmp_path, "actor.backend=megatron:d2p2t1", "hex.transport=relay")
    rewrite = apply_plan(config, _pipelined_plan())
    assert config.actor.backend == "megatron:d2p2t1" and uses_relay(config)
    assert len(rewrite.placement.for_role("actor")) == 4
    path = plugin.HEX_TRAIN_ENGINES["relay", "megatron"]
    assert path == "areal_hex_plugin.areal.megatron_actor.HexMegatronRelayActor"


def test_relay_refuses_the_bridge_export_that_gives_every_stage_the_whole_model(
    tmp_path: Path, monkeypatch
) -> None:
    from areal_hex_plugin.areal.preflight import check_transport

    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", "test-token-0123456789abcdef")

    config = _config(tmp_path, "actor.backend=megatron:d2p2t1", "hex.transport=relay")
    check_transport(config)  # upstream's default: the convert_to_hf path, each stage its own layers
    config.actor.megatron.bridge_type = "megatron-bridge"
    config.actor.megatron.use_bridge_for_update_weights = True
    with pytest.raises(HexError, match="every pipeline stage the whole model") as err:
        check_transport(config)
    assert err.value.field == "actor.megatron.use_bridge_for_update_weights"


def test_hf_names_go_to_the_stage_that_holds_their_layer() -> None:
    layers = (20, 8)
    assert layer_stage("model.layers.0.self_attn.q_proj.weight", layers) == 0
    assert layer_stage("model.layers.19.mlp.down_proj.weight", layers) == 0
    assert layer_stage("model.layers.20.input_layernorm.weight", layers) == 1
    assert layer_stage("model.layers.27.mlp.experts.3.up_proj.weight", layers) == 1
    assert layer_stage("model.embed_tokens.weight", layers) is None  # not a decoder layer
    assert layer_stage("lm_head.weight", layers) is None
    with pytest.raises(ValueError, match="layer 28 is beyond the planned 28 layers"):
        layer_stage("model.layers.28.mlp.up_proj.weight", layers)


def test_megatron_xccl_refuses_rollout_pipelines_its_training_does_not_match(tmp_path: Path) -> None:
    from areal_hex_plugin.planner.caps import caps_for, unmet

    plan = _pipelined_plan()
    caps = caps_for("megatron", "upstream", "xccl")
    assert unmet(plan, caps) == {}
    groups = [replace(g, tp=1, pp=2, count=1) for g in plan.rollout.replicas]
    lacking = unmet(replace(plan, rollout=replace(plan.rollout, replicas=groups)), caps)
    assert "train pp = rollout pp" in lacking["rollout pipeline"]
    assert (
        unmet(
            replace(plan, rollout=replace(plan.rollout, replicas=groups)),
            caps_for("megatron", "upstream", "disk"),
        )
        == {}
    )
