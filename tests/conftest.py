"""Shared test fixtures: isolate every test from the user's home folder and wandb."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*/*.yaml"))
# A local Ray node waits 30 s for its GCS to start by default; on a loaded 2-core CI machine that start has taken
# longer (the hex_ray e2e failed there waiting for gcs_server_port). Set here, before any fixture starts Ray.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "180")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(home / "wandb"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a `slow` test first, in their order, then the rest: under the two xdist workers (one file at a
    time each, see pyproject.toml) the long files start early instead of leaving one worker alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture
def transport_token(monkeypatch: pytest.MonkeyPatch) -> str:
    """The relay's shared secret, as a run (and its pre-flight, the dry run too) needs it."""
    token = "test-token-0123456789abcdef"
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", token)
    return token
