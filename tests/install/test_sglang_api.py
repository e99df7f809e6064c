"""The sglang the GPU profile installs has every name, call shape, option and HTTP route that upstream's launcher
and this plugin use. (Whether the profile resolves at all: ``test_gpu_resolution.py``.)

The pinned sglang is areal 1.0.4's own (``areal[sglang]``), which ``scripts/gpu-constraints.txt`` pins too. Its
wheel is fetched once from PyPI without its dependencies (``tests/install/wheels.py``) and read as text, never
imported; areal's requirements come from its installed metadata.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import RECIPES, REPO
from tests.install import sglang_api, wheels

areal_spec = pytest.importorskip("areal").__path__[0]
AREAL = Path(areal_spec)
LAUNCHER = sorted((AREAL / "experimental/inference_service/sglang").glob("*.py"))
PLUGIN_USERS = [REPO / "areal_hex_plugin/areal/profile_decode.py"]
# The plugin's reads of what the engine returns (profile_decode._engine_limits and _check_outputs).
ENGINE_KEYS = ("internal_states", "effective_max_running_requests_per_dp", "max_total_num_tokens", "meta_info",
               "completion_tokens", "total_retractions")  # fmt: skip
# The sglang the GPU profile once pinned (it could not be installed, nor run): the checks must catch it.
OLD_SGLANG = "0.5.23"


def pinned_sglang() -> str:
    """The sglang version areal 1.0.4's ``sglang`` extra pins (and the GPU profile's constraints repeat)."""
    pins = {
        spec.version
        for line in wheels.installed_requires("areal")
        if (req := Requirement(line)).name == "sglang"
        for spec in req.specifier
        if spec.operator == "=="
    }
    constraints = (REPO / "scripts/gpu-constraints.txt").read_text().splitlines()
    constrained = [line.split("==")[1] for line in constraints if line.startswith("sglang==")]
    assert len(pins) == 1 and constrained == list(pins), (pins, constrained)
    return pins.pop()


@pytest.fixture(scope="module")
def sglang_wheel() -> Path:
    return wheels.cached_wheel("sglang", pinned_sglang())


def test_pinned_sglang_has_what_upstream_and_the_plugin_use(sglang_wheel) -> None:
    source = sglang_api.SglangSource(sglang_wheel)
    problems = [
        p
        for path in LAUNCHER + PLUGIN_USERS
        for p in sglang_api.check_consumer(source, path, str(path.relative_to(path.parents[2])))
    ]
    assert problems == []
    # Every endpoint upstream's SGLang backend calls (the relay sink loads weights through them too).
    endpoints = set(re.findall(r'endpoint="(/[\w/]+)"', (AREAL / "engine/sglang_remote.py").read_text()))
    assert endpoints and endpoints <= sglang_api.routes(source)
    # The keys the plugin reads from the engine's answers are ones sglang writes.
    text = (REPO / "areal_hex_plugin/areal/profile_decode.py").read_text()
    written = set(re.findall(r'"(\w+)"', source.text("sglang/srt/managers/scheduler.py")))
    written |= set(re.findall(r'"(\w+)"', source.text("sglang/srt/managers/tokenizer_manager.py")))
    written |= set(re.findall(r'"(\w+)"', source.text("sglang/srt/entrypoints/engine.py")))
    assert all(f'"{key}"' in text for key in ENGINE_KEYS)
    assert set(ENGINE_KEYS) <= written


@pytest.mark.integration
@pytest.mark.slow
def test_pinned_sglang_takes_the_plugins_engine_args(sglang_wheel, monkeypatch) -> None:
    from areal.utils import pkg_version

    from areal_hex_plugin.areal import profile_decode as pd
    from areal_hex_plugin.areal.config import load_hex_config

    source = sglang_api.SglangSource(sglang_wheel)
    pinned = Version(pinned_sglang())
    # upstream's build_args asks for the installed sglang's version: answer with the pinned one's.
    monkeypatch.setattr(pkg_version, "is_version_greater_or_equal", lambda _, v: pinned >= Version(v))
    options = source.fields("sglang.srt.server_args", "ServerArgs")
    sampling = source.parameters("sglang.srt.sampling.sampling_params", "SamplingParams", "__init__")
    for recipe in RECIPES:
        config, _ = load_hex_config(["--config", str(recipe)])
        for gpu_type, hbm in (("H100", 80.0), ("A100", 80.0), ("L40S", 48.0)):
            unknown = set(pd.engine_args(config, 1, gpu_type, hbm)) - options
            assert not unknown, f"{recipe.name} on {gpu_type}: not ServerArgs options: {sorted(unknown)}"
        assert {*pd._sampling(config.gconfig), "max_new_tokens", "ignore_eos"} <= sampling


@pytest.mark.slow
def test_the_check_catches_the_sglang_the_profile_once_pinned() -> None:
    source = sglang_api.SglangSource(wheels.cached_wheel("sglang", OLD_SGLANG))
    problems = [p for path in LAUNCHER for p in sglang_api.check_consumer(source, path, path.name)]
    assert any("import configure_scheduler: sglang has no such name" in p for p in problems)
    assert any("unpacks 5 values from _launch_subprocesses, which returns [6" in p for p in problems)
