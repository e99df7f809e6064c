"""The GPU install profiles resolve against the package index, as ``scripts/setup.sh --gpu [--megatron]`` installs
them: uv with upstream AReaL's overrides (``scripts/gpu-overrides.txt``) and its lock's inference stack
(``scripts/gpu-constraints.txt``), for Linux x86_64. Resolution only (metadata; nothing is installed and no CUDA
wheel is downloaded), through ``setup.sh --resolve``, the very command line the install runs. Without an override
the GPU profile does not resolve (what a plain ``pip install -e ".[gpu,dev]"`` met).

One resolve per profile plus the negative one, run at once: about 30-40 s here, mostly waiting on the index; uv's cache lives in
``.cache/uv`` so later runs mostly revalidate. Skipped, saying so, only when the index cannot be reached.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import REPO

pytestmark = pytest.mark.slow
SETUP = REPO / "scripts" / "setup.sh"
OVERRIDES = REPO / "scripts" / "gpu-overrides.txt"
INDEX = os.environ.get("UV_DEFAULT_INDEX") or os.environ.get("UV_INDEX_URL") or "https://pypi.org/simple"
UV = Path(sys.executable).with_name("uv")
# What upstream's areal 1.0.4 runs with (its pins and its lock's stack): the profiles must land on exactly these.
STACK = {
    "areal": "1.0.4",
    "sglang": "0.5.10.post1",
    "torch": "2.9.1",
    "flashinfer-python": "0.6.7.post3",
    "flash-attn-4": "4.0.0b10",
    "nvidia-cudnn-cu12": "9.16.0.29",
    "transformers": "5.3.0",
}
MEGATRON = {
    "megatron-core": "0.17.0",
    "megatron-bridge": "0.4.0",
    "mbridge": "0.15.1",
    "hydra-core": "1.4.0.dev1",
}


@pytest.fixture(scope="module")
def index() -> str:
    try:
        urllib.request.urlopen(f"{INDEX.rstrip('/')}/areal/", timeout=15).close()
    except OSError as error:
        pytest.skip(
            f"package index {INDEX} unreachable ({error}): the GPU profiles' resolution is not checked"
        )
    if not UV.exists():
        pytest.fail(f"no uv beside {sys.executable}: bash scripts/setup.sh (the dev extra installs it)")
    return INDEX


def resolve(*flags: str, overrides: Path = OVERRIDES) -> subprocess.Popen:
    """``setup.sh --gpu FLAGS --resolve``, started (the resolves run at once: each mostly waits on the index)."""
    env = {
        **os.environ,
        "UV": str(UV),
        "HEX_GPU_OVERRIDES": str(overrides),
        "UV_CACHE_DIR": str(REPO / ".cache/uv"),
    }
    return subprocess.Popen(
        ["bash", str(SETUP), "--gpu", *flags, "--resolve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture(scope="module")
def resolved(index: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    """Return code, stdout and stderr of the GPU profile, the Megatron profile, and the GPU profile resolved
    without upstream's cuDNN override (the conflict a plain ``pip install -e ".[gpu,dev]"`` met)."""
    fewer = tmp_path_factory.mktemp("overrides") / "overrides.txt"
    lines = OVERRIDES.read_text().splitlines()
    fewer.write_text("\n".join(line for line in lines if not line.startswith("nvidia-cudnn-cu12")) + "\n")
    assert len(fewer.read_text().splitlines()) == len(lines) - 1
    started = {
        "gpu": resolve(),
        "megatron": resolve("--megatron"),
        "no_cudnn_override": resolve(overrides=fewer),
    }
    done = {}
    for name, proc in started.items():
        try:
            out, err = proc.communicate(timeout=600)
        finally:
            proc.kill()
        done[name] = (proc.returncode, out, err)
    return done


def versions(result: tuple[int, str, str]) -> dict[str, str]:
    returncode, out, err = result
    assert returncode == 0, err[-3000:]
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", out, re.MULTILINE))


def plugin_pins() -> dict[str, str]:
    """The plugin's own exact pins that the GPU profiles install (core dependencies and the dev extra)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(line)
        for spec in req.specifier:
            if spec.operator == "==":
                pins[req.name] = spec.version
    return pins


def test_gpu_profile_resolves_to_upstreams_stack(resolved) -> None:
    got = versions(resolved["gpu"])
    assert {name: got.get(name) for name in STACK} == STACK
    assert {name: got.get(name) for name in plugin_pins()} == plugin_pins()


def test_megatron_profile_resolves_on_python_312(resolved) -> None:
    got = versions(resolved["megatron"])
    assert {name: got.get(name) for name in {**STACK, **MEGATRON}} == {**STACK, **MEGATRON}
    assert {name: got.get(name) for name in plugin_pins()} == plugin_pins()
    # upstream's overrides leave out the CUDA source builds megatron-bridge asks for (optional, per its docs).
    assert not {"transformer-engine", "mamba-ssm", "nvidia-resiliency-ext"} & set(got)


def test_without_upstreams_cudnn_override_the_gpu_profile_does_not_resolve(resolved) -> None:
    """areal[sglang] pins cuDNN 9.16.0.29, the torch 2.9.1 that sglang pins wants 9.10.2.21."""
    returncode, _, err = resolved["no_cudnn_override"]
    assert returncode != 0 and "No solution found" in err, err[-3000:]
    assert "nvidia-cudnn-cu12" in err and "9.10.2.21" in err and "9.16.0.29" in err
