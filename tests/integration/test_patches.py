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
holder = type("H", (), {{"config": config, "scheduler": None}})()
assert type(PPOTrainer._init_scheduler(holder)) is LocalScheduler
assert PPOTrainer._rollout_engine_cls(holder, "sglang") is RemoteSGLangEngine
own_engine = type("OwnEngine", (RemoteSGLangEngine,), {{}})
holder.scheduler = type("S", (), {{"rollout_engine_cls": lambda self, backend: own_engine}})()
assert PPOTrainer._rollout_engine_cls(holder, "sglang") is own_engine
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


# Upstream's loader with upstream's GRPOConfig, the plugin loaded through its entry point (patches/0004, 0005).
LOAD_WITH_SECTION = """
import sys
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.infra.rpc.serialization import serialize_value
import orjson
config, _ = load_expr_config(sys.argv[1:], GRPOConfig)
assert isinstance(config, GRPOConfig)
print("LOADED", type(config).__module__, type(config).__name__, type(config.hex).__name__, config.hex.transport)
sys.stdout.flush()
sys.stderr.write("PAYLOAD" + orjson.dumps(serialize_value(config)).decode())
"""
# What an RPC worker does with the config it is sent (/configure): rebuild it by class path, in a fresh process.
WORKER_READS_IT = """
import sys
from areal.infra.rpc.serialization import deserialize_value
import orjson
config = deserialize_value(orjson.loads(sys.stdin.read()))
print("WORKER", type(config).__name__, type(config.hex).__name__, config.hex.cluster.pools[0].gpu_type, config.seed)
"""


def _patched_python(code: str, root: Path, args: list[str], **kw) -> subprocess.CompletedProcess:
    """``code`` run on the patched copy at ``root`` with the plugin importable."""
    env = {"PYTHONPATH": f"{root}:{REPO}", "HOME": str(root), "PATH": "/usr/bin:/bin", **kw.pop("env", {})}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300, **kw
    )


def _said(tag: str, stdout: str) -> list[str]:
    """The words of the one line of ``stdout`` that starts with ``tag`` (upstream logs to stdout as well)."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(tag + " ")]
    return line.split()[1:]


@pytest.mark.slow
def test_upstreams_grpo_config_takes_the_plugins_hex_section(tmp_path: Path) -> None:
    # Before patches/0005: ConfigKeyError: Key 'hex' not in 'GRPOConfig', whatever else was applied.
    check_patches.apply_all(tmp_path)
    recipe = [
        "--config",
        str(REPO / "recipes" / "ci" / "tiny.yaml"),
        f"cluster.fileroot={tmp_path / 'exp'}",
        f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}",
    ]
    loaded = _patched_python(LOAD_WITH_SECTION, tmp_path, recipe)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert _said("LOADED", loaded.stdout) == ["areal.api.plugins", "GRPOConfig", "HexConfig", "relay"]
    payload = loaded.stderr.rsplit("PAYLOAD", 1)[1]
    worker = _patched_python(WORKER_READS_IT, tmp_path, [], input=payload)
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert _said("WORKER", worker.stdout) == ["GRPOConfig", "HexConfig", "CPU-BIG", "1"]
    # No plugin loaded, no section: upstream's own refusal of the unknown key.
    bare = _patched_python(LOAD_WITH_SECTION, tmp_path, recipe, env={"AREAL_PLUGINS": "none"})
    assert bare.returncode != 0 and "Key 'hex' not in 'GRPOConfig'" in bare.stderr


def test_the_installed_wheel_is_unpatched() -> None:
    # So every other test proves the plugin works without the patches.
    from areal.trainer.rl_trainer import PPOTrainer

    assert not hasattr(PPOTrainer, "_rollout_engine_cls")
    assert importlib.util.find_spec("areal.api.weight_transport") is None
    assert importlib.util.find_spec("areal.api.plugins") is None
