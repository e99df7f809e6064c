"""patches/: they apply cleanly to the installed wheel and do what they say; the plugin runs without them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("areal")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "patches"))
import check_patches  # noqa: E402

pytestmark = pytest.mark.integration

PROBE = """
from areal.trainer.rl_trainer import PPOTrainer
from areal.api.cli_args import GRPOConfig
from areal.api.weight_transport import get_weight_transport, register_weight_transport
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.infra.scheduler.local import LocalScheduler

config = GRPOConfig(experiment_name="p", trial_name="t")
config.scheduler.type = "areal.infra.scheduler.local.LocalScheduler"
config.cluster.fileroot = "{root}"
config.cluster.name_resolve.nfs_record_root = "{root}"
holder = type("H", (), {{"config": config}})()
assert type(PPOTrainer._init_scheduler(holder)) is LocalScheduler
assert PPOTrainer._rollout_engine_cls(holder, "sglang") is RemoteSGLangEngine
register_weight_transport("hex", object())
assert get_weight_transport("hex") is not None
from areal.api.plugins import get_scheduler, register_scheduler
register_scheduler("probe", LocalScheduler)
config.scheduler.type = "probe"
assert type(PPOTrainer._init_scheduler(holder)) is LocalScheduler and get_scheduler("nope") is None
print("patched areal works")
"""


def test_patches_apply_and_work(tmp_path: Path) -> None:
    results = check_patches.apply_all(tmp_path)
    assert [ok for _, ok, _ in results] == [True] * len(check_patches.PATCHES), results
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(root=tmp_path)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "patched areal works" in proc.stdout


def test_the_installed_wheel_is_unpatched() -> None:
    # So every other test proves the plugin works without the patches.
    from areal.trainer.rl_trainer import PPOTrainer

    assert not hasattr(PPOTrainer, "_rollout_engine_cls")
    assert importlib.util.find_spec("areal.api.weight_transport") is None
    assert importlib.util.find_spec("areal.api.plugins") is None
