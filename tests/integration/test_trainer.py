"""HexPPOTrainer._init_scheduler: the seam upstream calls before parsing any backend string."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal.api.alloc_mode import ModelAllocation  # noqa: E402
from areal.utils.stats_logger import StatsLogger  # noqa: E402

from areal_hex_plugin.areal.config import load_hex_config  # noqa: E402
from areal_hex_plugin.areal.schedulers.local import HexLocalScheduler  # noqa: E402
from areal_hex_plugin.areal.session import HexSession, recipe_from_config  # noqa: E402
from areal_hex_plugin.areal.trainer import PLAN_FILE, HexPPOTrainer  # noqa: E402
from areal_hex_plugin.areal.worker_slots import node_local  # noqa: E402
from areal_hex_plugin.planner import plan_recipe  # noqa: E402
from areal_hex_plugin.specs.recipe import load_recipe  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes/paper/7b.yaml"


@pytest.mark.integration
def test_init_scheduler_rewrites_config_saves_plan_and_builds_the_hex_scheduler(tmp_path: Path) -> None:
    (tmp_path / "nr").mkdir()
    overrides = [f"cluster.fileroot={tmp_path}", f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}"]
    config, _ = load_hex_config(["--config", str(RECIPE), *overrides])
    plan = plan_recipe(load_recipe(RECIPE, overrides))
    built = []

    def make_scheduler():
        from areal_hex_plugin.areal.worker_slots import placement_from_plan

        built.append(HexLocalScheduler(node_local(placement_from_plan(plan), plan), exp_config=config))
        return built[-1]

    # Everything PPOTrainer.__init__ does before this call needs a tokenizer download; the seam itself does not.
    trainer = HexPPOTrainer.__new__(HexPPOTrainer)
    trainer.config, trainer._make_scheduler = config, make_scheduler
    trainer.hex_session = _session(config, plan)
    scheduler = trainer._init_scheduler()

    assert scheduler is built[0]
    actor = ModelAllocation.from_str(config.actor.backend)
    rollout = ModelAllocation.from_str(config.rollout.backend)
    assert actor.parallel.world_size == sum(plan.train.gpus.values())
    assert rollout.parallel.dp_size == sum(g.count for g in plan.rollout.replicas)
    assert config.rollout.max_head_offpolicyness == plan.staleness.max_head_offpolicyness
    assert config.rollout.max_concurrent_rollouts == plan.staleness.max_concurrent_rollouts
    saved = Path(StatsLogger.get_log_path(config.stats_logger))
    assert (saved / "config.yaml").exists()  # upstream's, written by load_expr_config
    assert json.loads((saved / PLAN_FILE).read_text())["model"] == plan.model


def _session(config, plan) -> HexSession:
    """The session the pre-flight opens for ``config`` and ``plan`` (its rewrite applied to ``config``)."""
    from areal_hex_plugin.areal.rewrite import apply_plan

    return HexSession(recipe_from_config(config, RECIPE), config, plan, "test", apply_plan(config, plan))


def _two_pool_config(tmp_path: Path, *overrides: str):
    """The 7b recipe (upstream's reader) with the pools of tests/integration/plans.py's two-type plan."""
    from areal_hex_plugin.specs.config import PoolConfig

    (tmp_path / "nr").mkdir()
    paths = [f"cluster.fileroot={tmp_path}", f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}"]
    config, _ = load_hex_config(["--config", str(RECIPE), *paths, *overrides])
    config.hex.cluster.pools = [
        PoolConfig(name="big", gpu_type="H100", gpus_per_machine=2, machines=2, price_per_gpu_hour=3.0),
        PoolConfig(
            name="small", gpu_type="L40S", gpus_per_machine=2, machines=2, price_per_gpu_hour=1.0,
            inter_machine_gb_per_s=3.0,
        ),
    ]  # fmt: skip
    return config


@pytest.mark.integration
def test_relay_transport_gets_the_fsdp_actor_and_the_plans_pools(tmp_path: Path) -> None:
    from areal_hex_plugin.areal.transport_setup import transport_settings
    from areal_hex_plugin.areal.worker_slots import placement_from_plan
    from areal_hex_plugin.transport.controller_adapter import HexPPOActorController
    from tests.integration.plans import two_type_plan

    config = _two_pool_config(tmp_path)
    plan = two_type_plan()
    cluster = recipe_from_config(config, RECIPE).cluster
    settings = transport_settings(placement_from_plan(plan), cluster, config.hex.relay)
    got = [(p.name, p.workers, p.cross_gb_per_s, p.intra_gb_per_s) for p in settings.pools]
    assert got == [("big", [0, 1], 12.5, 12.5), ("small", [2, 3, 4, 5], 1.5, 3.0)]

    trainer = HexPPOTrainer.__new__(HexPPOTrainer)
    trainer.config = config
    trainer.scheduler = HexLocalScheduler(node_local(placement_from_plan(plan), plan), exp_config=config)
    trainer.hex_session = _session(config, plan)
    config.hex.transport = "relay"
    relay = trainer._create_train_engine(config.actor, ModelAllocation.from_str("fsdp:d2"))
    assert isinstance(relay, HexPPOActorController)
    # Configured as the engine is made: upstream's recovery updates weights before __init__ returns.
    assert relay.hex_settings == settings
    config.hex.transport = "upstream"
    plain = trainer._create_train_engine(config.actor, ModelAllocation.from_str("fsdp:d2"))
    assert not isinstance(plain, HexPPOActorController)


@pytest.mark.integration
def test_recipe_relay_options_reach_the_sender_receivers_and_commit_check(tmp_path: Path) -> None:
    import inspect

    from areal_hex_plugin.areal.transport_setup import transport_settings
    from areal_hex_plugin.areal.worker_slots import placement_from_plan
    from areal_hex_plugin.specs.config import RelayConfig
    from areal_hex_plugin.transport.sender import SenderConfig
    from areal_hex_plugin.transport.sglang_adapter import RelayReceiverMixin
    from tests.integration.plans import two_type_plan

    overrides = ["hex.relay.backend=gloo", "hex.relay.min_committed_fraction=0.5", "hex.relay.chunk_mb=8"]
    more = ["hex.relay.bind_interface=lo", "hex.relay.allowed_hosts=[10.0.0.1]", "hex.relay.on_failure=fail"]
    config = _two_pool_config(tmp_path, *overrides, *more)
    assert load_recipe(RECIPE, overrides + more).hex.relay == config.hex.relay  # the core reader agrees
    plan = two_type_plan()
    trainer = HexPPOTrainer.__new__(HexPPOTrainer)
    trainer.config = config
    trainer.scheduler = HexLocalScheduler(node_local(placement_from_plan(plan), plan), exp_config=config)
    trainer.hex_session = _session(config, plan)
    settings = trainer._create_train_engine(config.actor, ModelAllocation.from_str("fsdp:d2")).hex_settings

    assert SenderConfig(**settings.sender) == SenderConfig(
        backend="gloo", timeout_s=30.0, chunk_bytes=8 << 20, on_failure="fail", max_resends=3
    )
    assert settings.receiver == {
        "timeout_s": 30.0,
        "allowed_hosts": ["10.0.0.1"],
        "bind_interface": "lo",
        "stage_dir": "/dev/shm",
        "rollback_dir": "/var/tmp",
    }
    assert settings.min_committed_fraction == 0.5
    assert [p.name for p in settings.pools] == ["big", "small"]

    # The recipe's defaults are the transport's own: a recipe without overrides changes nothing.
    cluster = trainer.hex_session.recipe.cluster
    default = transport_settings(placement_from_plan(plan), cluster, RelayConfig())
    assert SenderConfig(**default.sender) == SenderConfig()
    start = inspect.signature(RelayReceiverMixin.hex_start_receiver).parameters
    # hex_start_receiver reads allowed_hosts=None as [] (any peer holding the token).
    expected = {**default.receiver, "allowed_hosts": None}
    assert {name: start[name].default for name in default.receiver} == expected


@pytest.mark.integration
@pytest.mark.parametrize("freq_epochs", [None, 1])
@pytest.mark.parametrize("freq_steps", [None, 3])
@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("has_valid_data", [False, True])
def test_the_eval_rollout_is_started_exactly_when_upstream_would_evaluate(
    freq_epochs, freq_steps, before, has_valid_data
) -> None:
    """``evaluates`` (whether HexPPOTrainer starts upstream's eval-rollout workers) against upstream's own
    Evaluator over two epochs of steps: the workers start where, and only where, some step evaluates."""
    from areal.api.cli_args import EvaluatorConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.utils.evaluator import Evaluator

    from areal_hex_plugin.areal.trainer import evaluates

    config = EvaluatorConfig(
        experiment_name="e", trial_name="t", fileroot="/tmp", freq_epochs=freq_epochs, freq_steps=freq_steps,
        freq_secs=None, eval_before_train=before,
    )  # fmt: skip
    spec = FinetuneSpec(total_train_epochs=2, dataset_size=20, train_batch_size=4)
    evaluator, calls = Evaluator(config, spec), []
    for global_step in range(spec.total_train_steps):
        epoch, step = divmod(global_step, spec.steps_per_epoch)
        evaluator.evaluate(lambda g=global_step: calls.append(g), epoch, step, global_step)
    upstream_evaluates = bool(calls) and has_valid_data  # upstream's _evaluate needs a validation set
    assert evaluates(config, has_valid_data) == upstream_evaluates, calls
