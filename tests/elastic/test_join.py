"""``areal-hex join`` on a run's plan: the request it records, and the ones it refuses (exit 2, one message)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.joins import JOIN_FILE, read_requests
from areal_hex_plugin.plan import HexPlan, PlanChange
from tests.elastic.plans import two_layout_plan


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory) -> HexPlan:
    return HexPlan.load(two_layout_plan(tmp_path_factory.mktemp("plan"), "hex_local"))


def _run_plan(folder: Path, plan: HexPlan, *changes: PlanChange) -> str:
    """The plan as a run keeps it beside its config, with ``changes`` recorded."""
    return str(replace(plan, changes=list(changes)).save(folder / "hex_plan.json"))


def _join(plan: str, pool: str, host: str, capsys) -> tuple[int, str]:
    code = main(["join", "--plan", plan, "--pool", pool, "--host", host])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_new_machine_is_recorded_once(laid_out, tmp_path, capsys):
    plan = _run_plan(tmp_path, laid_out)
    code, out = _join(plan, "small", "small-1", capsys)
    assert code == 0 and "join request 0" in out, out
    (line,) = (tmp_path / JOIN_FILE).read_text().splitlines()
    assert {k: v for k, v in json.loads(line).items() if k != "requested_at"} == {
        "pool": "small",
        "host": "small-1",
    }
    # Asked again before the run answered: refused, the file unchanged.
    code, out = _join(plan, "small", "small-1", capsys)
    assert code == 2 and "join request 0 for it is not answered yet" in out and "Traceback" not in out, out
    assert len((tmp_path / JOIN_FILE).read_text().splitlines()) == 1
    # Once the run records it serving, it is in use; once lost, it may join again.
    gained = PlanChange(
        kind="gained", hosts=["small-1/2"], reason="joined (join request 0), holds version 3", step=2
    )
    code, out = _join(_run_plan(tmp_path, laid_out, gained), "small", "small-1", capsys)
    assert code == 2 and "serves rollouts since step 2" in out, out
    lost = PlanChange(kind="lost", hosts=["small-1/2"], reason="2 health probes failed", step=5)
    assert _join(_run_plan(tmp_path, laid_out, gained, lost), "small", "small-1", capsys)[0] == 0
    requests, problems = read_requests(tmp_path / JOIN_FILE)
    assert [(r.index, r.host) for r in requests] == [(0, "small-1"), (1, "small-1")] and problems == []


def test_the_same_machine_back_after_its_server_was_lost(laid_out, tmp_path, capsys):
    code, out = _join(_run_plan(tmp_path, laid_out), "small", "small-0", capsys)
    assert code == 2 and "serves rollouts in the plan" in out, out
    lost = PlanChange(kind="lost", hosts=["small-0/1"], reason="2 health probes failed", step=1)
    assert _join(_run_plan(tmp_path, laid_out, lost), "small", "small-0", capsys)[0] == 0


@pytest.mark.parametrize(
    ("pool", "host", "message"),
    [
        ("medium", "medium-0", "'medium' is not a pool of the plan"),
        ("big", "small-0", "'small-0' is a machine of pool 'small'"),
        ("big", "big-0", "'big-0' is in use: it is a train machine of the plan"),
        ("big", "big-2", "'big-2' is in use: it serves rollouts in the plan"),
        ("small", "small 1", "'small 1' is not a host name"),
    ],
)
def test_a_request_that_cannot_join_is_refused(laid_out, tmp_path, capsys, pool, host, message):
    code, out = _join(_run_plan(tmp_path, laid_out), pool, host, capsys)
    assert code == 2 and message in out and "fix:" in out and "Traceback" not in out, out
    assert not (tmp_path / JOIN_FILE).exists()


def test_a_malformed_line_is_reported_and_keeps_the_numbering(tmp_path):
    path = tmp_path / JOIN_FILE
    path.write_text('{"pool": "small"}\nnot json\n{"pool": "small", "host": "small-1"}\n{"pool": "sm')
    requests, problems = read_requests(path)
    assert [(r.index, r.pool, r.host) for r in requests] == [(2, "small", "small-1")]
    assert [p.split(" is not")[0] for p in problems] == [f"{path} line 1", f"{path} line 2"]
    assert read_requests(path, 3) == ([], [])  # the unfinished last line waits for its newline
