"""One wheel fetched from the package index without its dependencies (cached), and installed requirements.

Nothing here imports the packages it reads, and no CUDA wheel is ever downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tests.conftest import REPO

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


def installed_requires(name: str) -> list[str]:
    return metadata.requires(name) or []
