"""register(): the plugin's one way in (entry point, driver, user script), idempotent; Hex schedulers built from
exp_config alone, as upstream's own trainers build a scheduler."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from dataclasses import fields
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal.api.cli_args import load_expr_config  # noqa: E402
from areal.infra.scheduler.local import LocalScheduler  # noqa: E402

from areal_hex_plugin.areal import plugin  # noqa: E402
from areal_hex_plugin.areal.config import HexGRPOConfig  # noqa: E402
from areal_hex_plugin.areal.schedulers.local import HexLocalScheduler  # noqa: E402
from areal_hex_plugin.errors import HexError  # noqa: E402
from tests.conftest import REPO  # noqa: E402

pytestmark = pytest.mark.integration
TABLES = (plugin.SCHEDULERS, plugin.ROLLOUT_ENGINES, plugin.TRAIN_ENGINES)
RECIPE = REPO / "recipes/paper/1.5b.yaml"
# One GPU of each type the 1.5b recipe's pools name, as nvidia-smi prints them.
NVIDIA_SMI = "#!/bin/sh\necho '0, NVIDIA H800 PCIe, 81559 MiB'\necho '1, NVIDIA H20, 97871 MiB'\n"


@pytest.fixture
def unregistered(monkeypatch: pytest.MonkeyPatch):
    """The plugin as a fresh process sees it: not registered, empty tables (restored afterwards)."""
    saved = [dict(t) for t in TABLES]
    for table in TABLES:
        table.clear()
    monkeypatch.setattr(plugin, "_registered", False)
    yield
    for table, items in zip(TABLES, saved, strict=True):
        table.clear()
        table.update(items)


def test_register_installs_each_item_once_and_only_if_missing(unregistered) -> None:
    plugin.SCHEDULERS["hex_local"] = "my.own.Scheduler"  # someone registered this name first
    plugin.register()
    assert plugin.SCHEDULERS == {**plugin.HEX_SCHEDULERS, "hex_local": "my.own.Scheduler"}
    assert plugin.ROLLOUT_ENGINES == plugin.HEX_ROLLOUT_ENGINES
    assert plugin.TRAIN_ENGINES == plugin.HEX_TRAIN_ENGINES

    before = [dict(t) for t in TABLES]
    del plugin.ROLLOUT_ENGINES["sglang"]  # a user took the engine out after registering
    plugin.register()
    assert [dict(t) for t in TABLES] == [before[0], {}, before[2]]  # the second call changed nothing


def test_registered_items_are_upstream_subclasses() -> None:
    from areal.api.scheduler_api import Scheduler
    from areal.engine.fsdp_engine import FSDPPPOActor
    from areal.engine.sglang_remote import RemoteSGLangEngine

    plugin.register()
    assert all(issubclass(plugin.load(p), Scheduler) for p in plugin.SCHEDULERS.values())
    assert issubclass(plugin.load(plugin.ROLLOUT_ENGINES["sglang"]), RemoteSGLangEngine)
    assert issubclass(plugin.load(plugin.TRAIN_ENGINES["relay", "fsdp"]), FSDPPPOActor)


def test_register_is_the_declared_entry_point() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][
        "areal.plugins"
    ]
    assert declared == {"hex": "areal_hex_plugin.areal.plugin:register"}
    # The installed metadata agrees (scripts/setup.sh re-installs when pyproject.toml changes).
    installed = {ep.name: ep for ep in entry_points(group="areal.plugins")}
    assert installed["hex"].load() is plugin.register


def test_no_production_module_uses_unittest_mock() -> None:
    users = [f for f in (REPO / "areal_hex_plugin").rglob("*.py") if "unittest.mock" in f.read_text()]
    assert users == []


@pytest.mark.usefixtures("transport_token", "no_ray_cluster")
def test_driver_registers_first(unregistered, tmp_path: Path) -> None:
    from areal_hex_plugin.driver import main

    (tmp_path / "nr").mkdir()
    argv = ["--config", str(RECIPE), f"cluster.fileroot={tmp_path}",
            f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}", "hex.dry_run=true"]  # fmt: skip
    assert main(argv) == 0
    assert plugin.SCHEDULERS == plugin.HEX_SCHEDULERS


RELAY_TOKEN = "0123456789abcdef0123456789abcdef"


def _user_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> HexGRPOConfig:
    """What a user script does: upstream's loader with HexGRPOConfig, on a machine with one GPU of each type."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(NVIDIA_SMI)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    monkeypatch.setenv("HEX_LOCAL_SHARE_GPUS", "1")
    monkeypatch.setenv(
        "AREAL_HEX_TRANSPORT_TOKEN", RELAY_TOKEN
    )  # the recipe's relay: the scheduler checks it
    (tmp_path / "nr").mkdir()
    config, _ = load_expr_config(
        ["--config", str(RECIPE), f"cluster.fileroot={tmp_path}",
         f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}", *extra],
        HexGRPOConfig,
    )  # fmt: skip
    return config


def test_user_script_builds_a_hex_scheduler_from_exp_config_alone(tmp_path, monkeypatch) -> None:
    config = _user_config(tmp_path, monkeypatch, "scheduler.type=hex_local")
    plain_backend = config.actor.backend
    plugin.register()
    scheduler = plugin.load(plugin.SCHEDULERS[config.scheduler.type])(exp_config=config)

    assert isinstance(scheduler, HexLocalScheduler) and isinstance(scheduler, LocalScheduler)
    # It planned from config.hex and rewrote the config to that plan, as the driver does.
    from areal.api.alloc_mode import ModelAllocation

    trainers = scheduler.placement.slots["actor"]
    servers = scheduler.placement.slots["rollout"]
    assert config.actor.backend != plain_backend
    assert ModelAllocation.from_str(config.actor.backend).parallel.world_size == len(trainers)
    assert ModelAllocation.from_str(config.rollout.backend).parallel.dp_size == len(servers)
    assert {s.gpu_type for s in trainers} <= {"H800-PCIe", "H20"}
    assert scheduler.gpu_devices == [0, 1]  # this machine's two GPUs, shared by the planned roles


def test_scheduler_without_exp_config_or_placement_says_what_it_needs() -> None:
    with pytest.raises(HexError, match="needs the experiment config"):
        HexLocalScheduler()


PATCHED_PROBE = """
from areal.api.cli_args import load_expr_config
from areal.trainer.rl_trainer import PPOTrainer
from areal_hex_plugin.areal.config import HexGRPOConfig
from areal_hex_plugin.areal.schedulers.local import HexLocalScheduler

# No register() here: for hex_local upstream's loader (patches/0004) calls it through the entry point.
for kind in ("hex_local", "areal_hex_plugin.areal.schedulers.local.HexLocalScheduler"):
    config, _ = load_expr_config([*{argv!r}, "scheduler.type=" + kind], HexGRPOConfig)
    holder = type("H", (), {{"config": config}})()
    scheduler = PPOTrainer._init_scheduler(holder)  # upstream's own factory
    assert type(scheduler) is HexLocalScheduler, type(scheduler)
    assert config.actor.backend.startswith("fsdp:d"), config.actor.backend
    print("upstream built", type(scheduler).__name__, "for", kind)
"""


@pytest.mark.slow
def test_patched_upstream_trainer_builds_hex_schedulers_by_name_and_class_path(tmp_path: Path) -> None:
    """With patches/ applied, a plain upstream trainer builds a Hex scheduler from exp_config alone: by the
    name register() put in upstream's registry (0004's entry-point loader), and by class path (0001)."""
    sys.path.insert(0, str(REPO / "patches"))
    import check_patches

    areal_root = tmp_path / "areal-patched"
    areal_root.mkdir()
    assert all(ok for _, ok, _ in check_patches.apply_all(areal_root))
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(NVIDIA_SMI)
    fake.chmod(0o755)
    (tmp_path / "nr").mkdir()
    argv = ["--config", str(RECIPE), f"cluster.fileroot={tmp_path}",
            f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", PATCHED_PROBE.format(argv=argv)],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            "PYTHONPATH": f"{areal_root}:{REPO}",
            "HOME": str(tmp_path),
            "WANDB_MODE": "offline",
            "PATH": f"{fake.parent}:/usr/bin:/bin",
            "HEX_LOCAL_SHARE_GPUS": "1",
            "AREAL_HEX_TRANSPORT_TOKEN": RELAY_TOKEN,
        },  # fmt: skip
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "upstream built HexLocalScheduler for hex_local" in proc.stdout
    assert (
        "upstream built HexLocalScheduler for areal_hex_plugin.areal.schedulers.local.HexLocalScheduler"
        in proc.stdout
    )


def test_readme_user_script_names_what_exists() -> None:
    """docs/running.md's upstream-style script parses, and everything it imports is there (it runs for real on a
    cluster; here the imports and the trainer's keywords)."""
    import ast
    import importlib
    import inspect
    import re

    from areal_hex_plugin.areal.trainer import HexPPOTrainer

    readme = (REPO / "docs/running.md").read_text()
    script = re.search(r"## Your own script.*?```python\n(.*?)```", readme, flags=re.S).group(1)
    tree = ast.parse(script)
    imported = [(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert ("areal_hex_plugin.areal.plugin", "register") in imported
    for module, name in imported:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
    assert "config.hex.workflow" in script and "workflow" in {f.name for f in fields(HexGRPOConfig().hex)}
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "HexPPOTrainer"
    ]
    inspect.signature(HexPPOTrainer).bind(*[None] * len(calls[0].args))
