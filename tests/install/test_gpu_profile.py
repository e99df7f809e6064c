"""The GPU install profile (``pip install -e ".[gpu,dev]"``) on CPU, without CUDA wheels: its exact pins agree, and
the sglang it pins has every name, call shape, option and HTTP route that upstream's launcher and this plugin use.

The pinned sglang's wheel is fetched once from PyPI without its dependencies (``tests/install/wheels.py``) and read
as text; areal's requirements come from its installed metadata.
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
# The profile this replaced: the CPU `areal` extra beside sglang 0.5.23 (it could not be installed, nor run).
OLD_GPU_EXTRA = ["sglang==0.5.23"]


def _requires_of(sglang_wheel: Path | None) -> dict[str, list[str]]:
    """Whose requirements the profile check reads: installed metadata, and the sglang wheel's when given."""
    out = {name: wheels.installed_requires(name) for name in ("areal", "ortools", "omegaconf", "hydra-core")}
    return {**out, "sglang": wheels.wheel_requires(sglang_wheel)} if sglang_wheel else out


def _profile(extra: list[str]) -> list[str]:
    return wheels.pyproject()["dependencies"] + extra


def _pinned(needs: list[wheels.Need], name: str) -> str:
    pins = {
        s.version
        for n in needs
        if n.requirement.name == name
        for s in n.requirement.specifier
        if s.operator == "=="
    }
    assert len(pins) == 1, f"the GPU profile pins {name} {sorted(pins) or 'nowhere'}"
    return pins.pop()


@pytest.fixture(scope="module")
def gpu_profile() -> tuple[list[wheels.Need], Path]:
    """The GPU profile's requirements (one level below each package whose metadata is read) and its sglang wheel."""
    extras = wheels.pyproject()["optional-dependencies"]
    gpu = extras["gpu"]
    # The metadata read for areal is its installed 1.0.4's; the profile must pin that very release.
    from importlib.metadata import version

    areal_pin = _pinned(wheels.expand(gpu, "gpu extra", {}), "areal")
    assert areal_pin == version("areal")
    profile = _profile(gpu + extras["dev"])  # pip install -e ".[gpu,dev]"
    first = wheels.expand(profile, "areal-hex-plugin", _requires_of(None))
    sglang_wheel = wheels.cached_wheel("sglang", _pinned(first, "sglang"))
    return wheels.expand(profile, "areal-hex-plugin", _requires_of(sglang_wheel)), sglang_wheel


def test_gpu_profile_pins_agree(gpu_profile) -> None:
    needs, _ = gpu_profile
    assert wheels.pin_conflicts(needs) == []
    # Upstream's own pins decide sglang and torch: the CUDA torch sglang pins, inside areal's range.
    torch = Version(_pinned(needs, "torch"))
    areal_torch = [
        n.requirement.specifier for n in needs if n.requirement.name == "torch" and n.source == "areal"
    ]
    assert areal_torch and all(s.contains(torch) for s in areal_torch)
    # The installed metadata read for ortools & co. is that of the versions the profile pins.
    from importlib.metadata import version

    for name in ("ortools", "omegaconf", "hydra-core"):
        assert version(name) == _pinned(needs, name)


def test_pinned_sglang_has_what_upstream_and_the_plugin_use(gpu_profile) -> None:
    source = sglang_api.SglangSource(gpu_profile[1])
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
def test_pinned_sglang_takes_the_plugins_engine_args(gpu_profile, monkeypatch) -> None:
    from areal.utils import pkg_version

    from areal_hex_plugin.areal import profile_decode as pd
    from areal_hex_plugin.areal.config import load_hex_config

    source = sglang_api.SglangSource(gpu_profile[1])
    pinned = Version(_pinned(gpu_profile[0], "sglang"))
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
def test_the_check_catches_the_profile_it_replaced() -> None:
    old_wheel = wheels.cached_wheel("sglang", next(iter(Requirement(OLD_GPU_EXTRA[0]).specifier)).version)
    cpu_extra = wheels.pyproject()["optional-dependencies"]["areal"]
    needs = wheels.expand(_profile(cpu_extra + OLD_GPU_EXTRA), "areal-hex-plugin", _requires_of(old_wheel))
    conflicts = wheels.pin_conflicts(needs)
    assert any(c.startswith("torch: areal-hex-plugin pins ==2.13.0, sglang asks ==2.14.1") for c in conflicts)

    source = sglang_api.SglangSource(old_wheel)
    problems = [p for path in LAUNCHER for p in sglang_api.check_consumer(source, path, path.name)]
    assert any("import configure_scheduler: sglang has no such name" in p for p in problems)
    assert any("unpacks 5 values from _launch_subprocesses, which returns [6" in p for p in problems)


def test_gpu_profile_with_megatron_pins_agree(gpu_profile) -> None:
    """pip install -e ".[gpu,megatron,dev]" on Python 3.12 (megatron-core's floor): still no pin refused."""
    extras = wheels.pyproject()["optional-dependencies"]
    profile = _profile(extras["gpu"] + extras["megatron"] + extras["dev"])
    env = {**wheels.GPU_ENV, "python_version": "3.12", "python_full_version": "3.12.3"}
    needs = wheels.expand(profile, "areal-hex-plugin", _requires_of(gpu_profile[1]), env)
    assert wheels.pin_conflicts(needs) == []
    assert _pinned(needs, "megatron-core") and _pinned(needs, "sglang") == _pinned(gpu_profile[0], "sglang")
