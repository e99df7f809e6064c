"""The run's session: one value carries the recipe, upstream's config and the plan, and a recipe's relative paths
are read from the recipe's folder wherever the session is made (the pre-flight, or a scheduler or trainer that
upstream builds from ``exp_config`` alone), whatever the current directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("areal")

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "ci" / "tiny.yaml"
LENGTHS = [1, 2, 2, 3]  # mean 2, against the lognormal mean of 4 the recipe names
MFU = 0.123


def relative_recipe(folder: Path) -> Path:
    """The CI recipe in ``folder`` with its profile and output lengths beside it, named by relative paths."""
    folder.mkdir()
    recipe = yaml.safe_load(TINY.read_text())
    recipe["hex"]["workload"]["model"] = str(REPO / "recipes" / "ci" / "tiny-qwen2")
    recipe["hex"]["workload"]["output_lengths"] = {"kind": "file", "path": "lengths.txt"}
    recipe["hex"]["calibration"] = {"profile": "profile.json"}
    (folder / "lengths.txt").write_text("".join(f"{n}\n" for n in LENGTHS))
    profile = {"format": "areal-hex-profile/1", "gpu_types": {"CPU-BIG": {"train_mfu": MFU}}}
    (folder / "profile.json").write_text(json.dumps(profile))
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.integration
def test_a_config_loaded_elsewhere_reads_relative_paths_from_the_recipes_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from areal_hex_plugin.areal.config import load_hex_config
    from areal_hex_plugin.areal.session import session_for

    recipe = relative_recipe(tmp_path / "recipes")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    argv = ["--config", str(recipe), f"cluster.fileroot={tmp_path / 'exp'}"]
    monkeypatch.setattr("sys.argv", ["gsm8k_rl.py", *argv])
    config, _ = load_hex_config(argv)

    session = session_for(config, "test")  # as a scheduler built from exp_config alone takes it

    assert session.recipe.calibration.for_gpu("CPU-BIG").train_mfu == MFU
    assert session.recipe.workload.output_lengths.mean == pytest.approx(sum(LENGTHS) / len(LENGTHS))
    assert session.recipe.path == recipe
    assert session_for(config, "test") is session  # one session per config: nothing is planned twice
    assert session.plan.recipe == str(recipe)


@pytest.mark.integration
def test_the_preflight_opens_the_session_that_schedulers_and_trainers_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport_token
) -> None:
    from areal_hex_plugin.areal.preflight import preflight
    from areal_hex_plugin.areal.session import session_for

    recipe = relative_recipe(tmp_path / "recipes")
    monkeypatch.chdir(tmp_path)
    session = preflight(str(recipe), [f"cluster.fileroot={tmp_path / 'exp'}"], offline=True)

    assert session_for(session.config, "test") is session
    assert session.recipe.calibration.for_gpu("CPU-BIG").train_mfu == MFU
    assert session.passed[-1].startswith("plan: solved at start")


@pytest.mark.integration
def test_a_session_upstreams_script_opens_checks_its_config_and_prints_the_pre_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Upstream's own script (patches/0004-0005) builds a Hex scheduler from ``exp_config``: no pre-flight ran, so
    the scheduler's session checks the config as the pre-flight does and prints its lines with the plan."""
    from areal_hex_plugin.areal.config import load_hex_config
    from areal_hex_plugin.areal.schedulers.common import announced_session

    argv = [
        "--config",
        str(TINY),
        f"cluster.fileroot={tmp_path / 'exp'}",
        "actor.weight_update_mode=hex_relay",
    ]
    monkeypatch.setattr("sys.argv", ["gsm8k_rl.py", *argv])
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", "t" * 32)
    config, _ = load_hex_config(argv)

    session = announced_session(config, "hex_local")

    printed = capsys.readouterr().out
    for line in ("scheduler: hex_local", "hex.workflow: ", "transport: relay (token set)"):
        assert any(line in passed for passed in session.passed), session.passed
        assert f"ok   {line}" in printed
    assert "# Plan" in printed and "# Placement" in printed


@pytest.mark.integration
def test_a_bad_config_upstreams_script_opens_is_refused_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from areal_hex_plugin.areal.config import load_hex_config
    from areal_hex_plugin.areal.schedulers.common import announced_session
    from areal_hex_plugin.errors import HexError

    argv = ["--config", str(TINY), f"cluster.fileroot={tmp_path / 'exp'}", "hex.workflow=nowhere.Workflow"]
    monkeypatch.setattr("sys.argv", ["gsm8k_rl.py", *argv])
    config, _ = load_hex_config(argv)
    with pytest.raises(HexError, match="nowhere.Workflow") as refused:
        announced_session(config, "hex_local")
    assert refused.value.field == "hex.workflow"
