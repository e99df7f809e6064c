"""Upstream's own ``examples/math/gsm8k_rl.py`` (AReaL v1.0.4, unmodified) runs ``recipes/ci/tiny.yaml`` for 3 steps
on CPU under ``scheduler.type=hex_local``, on a copy of the installed wheel with ``patches/`` applied.

The script loads the recipe with ``load_expr_config(args, GRPOConfig)`` and trains with upstream's ``PPOTrainer``.
The patches let it: ``GRPOConfig`` takes the plugin's ``hex:`` section (0005), the trainer builds the plugin's
scheduler from ``scheduler.type`` (0004), runs the rollout engine that scheduler names (0006: the plan's two server
layouts, the SGLang stand-in) and sends weights through the relay under ``actor.weight_update_mode=hex_relay``
(0003). The installed wheel itself is never patched: its RECORD hashes are checked before and after.

The script is upstream's, so it is not in this repository, and areal's sdist on PyPI carries no ``examples/``:
point ``AREAL_UPSTREAM_EXAMPLES`` at a checkout of upstream's tag v1.0.4 (the script's git blob is checked), e.g.
``git clone --depth 1 --branch v1.0.4 https://github.com/areal-project/AReaL``. Without it the test is skipped.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("areal")

from tests.e2e.run import (  # noqa: E402
    RELAY_CHUNK_BYTES,
    TOKEN,
    environment,
    new_mark,
    processes_left,
    run_driver,
)
from tests.transport.harness import relay_digest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "patches"))
import check_patches  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
EXAMPLES_ENV = "AREAL_UPSTREAM_EXAMPLES"
SCRIPT = Path("examples") / "math" / "gsm8k_rl.py"
SCRIPT_BLOB = (
    "4dbed5fa601fdcdeee8ad1624d5dec5e486ebc9f"  # git's blob id of the script at upstream's tag v1.0.4
)
STEPS = 3
TIMEOUT_S = 420
# The plan's two server layouts for the recipe (test_grpo_e2e checks the plan itself): tp1 on a CPU-BIG, tp2 on
# both CPU-SMALL GPUs.
SERVER_TP = {"big": 1, "small": 2}


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def upstream_script() -> Path:
    """Upstream's script from the checkout ``AREAL_UPSTREAM_EXAMPLES`` names, checked to be v1.0.4's, unmodified."""
    root = os.environ.get(EXAMPLES_ENV)
    if not root:
        pytest.skip(
            f"{EXAMPLES_ENV} is unset: it names a checkout of upstream AReaL v1.0.4 (see the docstring)"
        )
    script = Path(root) / SCRIPT
    assert git_blob_id(script.read_bytes()) == SCRIPT_BLOB, (
        f"{script} is not upstream's v1.0.4 script as released"
    )
    return script


def wheel_files_changed() -> list[str]:
    """The installed areal wheel's files whose bytes no longer match the sha256 in its RECORD (or are gone)."""
    changed = []
    for file in importlib.metadata.distribution("areal").files or []:
        if file.hash is None:  # RECORD itself, and files written after installing (bytecode)
            continue
        path = Path(file.locate())
        if not path.is_file() or file.hash.mode != "sha256" or _record_sha256(path) != file.hash.value:
            changed.append(str(file))
    return changed


def _record_sha256(path: Path) -> str:
    """A file's sha256 as a wheel's RECORD writes it (urlsafe base64, no padding)."""
    return base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


def test_upstreams_gsm8k_rl_script_runs_the_tiny_recipe_on_the_patched_wheel(tmp_path: Path) -> None:
    script = upstream_script()
    assert wheel_files_changed() == []
    patched = tmp_path / "areal-patched"
    patched.mkdir()
    assert [ok for _, ok, _ in check_patches.apply_all(patched)] == [True] * len(check_patches.PATCHES)
    mark = new_mark()
    env = environment(tmp_path, mark, {"HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2"})
    env["PYTHONPATH"] = f"{patched}{os.pathsep}{env['PYTHONPATH']}"  # the copy before the installed wheel
    run = run_driver(
        tmp_path,
        "hex_local",
        STEPS,
        env,
        TIMEOUT_S,
        extra=("actor.weight_update_mode=hex_relay",),
        program=(str(script),),
    )
    assert run.returncode == 0, run.log[-6000:]

    # Every step's weights went through the relay into both planned servers, each of its own layout, and each
    # served what the trainer sent (the relay's keyed digest recomputed from the weights it served).
    sent = run.relay_digests()
    assert sorted(sent) == list(range(1, STEPS + 1)), sent
    servers = run.server_logs()
    assert sorted(name.rsplit("-", 1)[0] for name in servers) == sorted(SERVER_TP)
    for name, records in servers.items():
        (start,) = [r for r in records if r["event"] == "start"]
        tp = SERVER_TP[name.rsplit("-", 1)[0]]
        assert start["tp_size"] == tp and len(start["planned_gpu_ids"].split()) == tp, (name, start)
        assert start["attention_backend"] == "flashinfer", start  # the plugin's flags for a type without FA3
        loads = [r for r in records if r["event"] == "load" and r["version"] != "default"]
        assert [r["version"] for r in loads] == [str(v) for v in sent], name
        for load in loads:
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
        assert any(r["event"] == "generate" for r in records), name
    assert processes_left(mark, wait_s=30) == []
    assert wheel_files_changed() == []
