"""Install profiles as data: one wheel fetched from PyPI without its dependencies (cached), requirements read from
wheel and installed metadata, and a check that every exact pin satisfies every other requirement on that package.

Nothing here imports the packages it reads, and no CUDA wheel is ever downloaded: areal's requirements come from
its installed metadata (installed with ``--no-deps``), sglang's from its own wheel, the plugin's from
pyproject.toml.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

# The GPU machines the profile targets.
GPU_ENV = {"sys_platform": "linux", "platform_machine": "x86_64", "python_version": "3.11",
           "python_full_version": "3.11.7", "platform_system": "Linux", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}  # fmt: skip
CACHE = Path(os.environ.get("AREAL_HEX_WHEEL_CACHE", REPO / ".cache" / "wheels"))


def cached_wheel(name: str, version: str) -> Path:
    """The wheel of ``name==version`` under :data:`CACHE`, fetched once from the package index (no deps)."""
    prefix = f"{name.replace('-', '_')}-{version}-"
    found = sorted(CACHE.glob(f"{prefix}*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
             "--disable-pip-version-check", "-d", str(CACHE), f"{name}=={version}"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        found = sorted(CACHE.glob(f"{prefix}*.whl"))
        if proc.returncode != 0 or not found:
            raise RuntimeError(
                f"could not download {name}=={version} from the package index (needed once, then cached in "
                f"{CACHE}): {proc.stderr.strip()[-500:]}"
            )
    return found[0]


def wheel_requires(wheel: Path) -> list[str]:
    """``Requires-Dist`` of a wheel, read from its METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(zf.read(name).decode()).get_all("Requires-Dist") or []


@dataclass(frozen=True)
class Need:
    requirement: Requirement
    source: str  # who asks for it


def expand(
    top: list[str], source: str, requires_of: dict[str, list[str]], env: dict[str, str] = GPU_ENV
) -> list[Need]:
    """``top`` and, one level down, the requirements of every package in ``requires_of`` that is asked for,
    with the extras asked for; markers evaluated for ``env``."""
    needs: list[Need] = []
    queue = [(req, source) for req in map(Requirement, top) if req.marker is None or req.marker.evaluate(env)]
    expanded: set[tuple[str, str]] = set()
    while queue:  # each entry's marker holds for env (and the extra that brought it in)
        req, who = queue.pop(0)
        needs.append(Need(req, who))
        name = canonicalize_name(req.name)
        for extra in ("", *sorted(req.extras)):
            if name not in requires_of or (name, extra) in expanded:
                continue
            expanded.add((name, extra))
            for line in requires_of[name]:
                sub = Requirement(line)
                # The base pass takes lines without an extra, each extra's pass the lines of that extra.
                if (sub.marker is not None and "extra" in str(sub.marker)) != bool(extra):
                    continue
                if sub.marker is None or sub.marker.evaluate({**env, "extra": extra}):
                    queue.append((sub, f"{req.name}[{extra}]" if extra else req.name))
    return needs


def pin_conflicts(needs: list[Need]) -> list[str]:
    """Every exact pin (``==``) that another requirement on the same package refuses, as one line each."""
    by_name: dict[str, list[Need]] = defaultdict(list)
    for need in needs:
        by_name[canonicalize_name(need.requirement.name)].append(need)
    out = []
    for name, group in sorted(by_name.items()):
        pins = [(s.version, n) for n in group for s in n.requirement.specifier if s.operator == "=="]
        for version, pinned_by in pins:
            for other in group:
                if other.requirement.specifier and not other.requirement.specifier.contains(
                    version, prereleases=True
                ):
                    out.append(
                        f"{name}: {pinned_by.source} pins =={version}, "
                        f"{other.source} asks {other.requirement.specifier}"
                    )
    return sorted(set(out))


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def installed_requires(name: str) -> list[str]:
    return metadata.requires(name) or []
