"""Shared test fixtures: isolate every test from the user's home folder and wandb."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*/*.yaml"))
# Ray 2.60's first local ray.init() in a process turns token authentication on for the process and its children
# (RAY_AUTH_MODE=token in os.environ) and writes its token to ~/.ray/auth_token. Each test has a HOME of its own,
# so a later test's local cluster found no token: its GCS aborted at start and Ray waited for it until it timed
# out. The test clusters run without it (the mode is read once per process, before any test starts Ray).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


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


@pytest.fixture(scope="session")
def refit_worker():
    """One online-refit worker process for the tests' refit loops (each loop would start its own: seconds)."""
    from areal_hex_plugin.planner.refit_worker import RefitWorker

    worker = RefitWorker()
    yield worker
    worker.stop()


@pytest.fixture
def transport_token(monkeypatch: pytest.MonkeyPatch) -> str:
    """The relay's shared secret, as a run (and its pre-flight, the dry run too) needs it."""
    token = "test-token-0123456789abcdef"
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", token)
    return token


@pytest.fixture
def no_ray_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Ray cluster reachable, whatever runs on the machine: ``ray.init(address="auto")`` joins any GCS process
    it finds, such as the local cluster (fake GPU nodes) another test worker has up, against which a dry run
    would then check its plan. Tests of the live inventory start their own cluster instead."""
    from areal_hex_plugin import inventory
    from areal_hex_plugin.errors import HexError

    def unreachable(address: str | None) -> list:
        raise HexError(
            "--address", f"cannot connect to a Ray cluster at {address or 'auto'}: none here", "start Ray"
        )

    monkeypatch.setattr(inventory, "ray_nodes", unreachable)
