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


def test_the_servers_a_joining_machine_runs(laid_out):
    from areal_hex_plugin.areal.join import Joined, machine_slots, on_this_node
    from areal_hex_plugin.areal.worker_slots import node_local, placement_from_plan
    from areal_hex_plugin.costmodel import CostModel
    from areal_hex_plugin.errors import HexError
    from areal_hex_plugin.joins import JoinRequest
    from areal_hex_plugin.planner.reshare import ServerShape
    from tests.elastic.plans import elastic_recipe

    recipe = elastic_recipe()
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    placement = node_local(placement_from_plan(laid_out), laid_out)  # as hex_local lays the machines out

    def slots(host: str, pool: str):
        return machine_slots(cm, laid_out, placement, JoinRequest(0, pool, host), 2, lambda s: s)

    # The same machine back: its planned server on its GPUs, as rank 2.
    back, new = slots("small-0", "small")
    assert not new and [(s.index, s.host, s.gpu_ids, s.tp, s.concurrency) for s in back] == [
        (2, "small-0", (3, 4), 2, 4)
    ]
    # A new machine: its pool's planned server (tp2, the plan's batch cap), on the node's free CPU-SMALL GPUs.
    fresh, new = slots("small-1", "small")
    assert new and [(s.index, s.host, s.gpu_ids, s.tp, s.concurrency, s.share) for s in fresh] == [
        (2, "small-1", (0, 1), 2, 4, 0.0)
    ]
    assert fresh[0].server_flags == back[0].server_flags
    # Re-shared at its cap, as the planned servers are (a joined server of a planned shape gets its share).
    assert Joined(fresh, [], lambda: None).shapes == [ServerShape("small", 2, 1, 4)]
    assert [s.gpu_ids for s in on_this_node(fresh, placement, {"CPU-BIG": 3, "CPU-SMALL": 4}, "r")] == [
        (5, 6)
    ]
    with pytest.raises(
        HexError, match="join request 0: this node has 2 CPU-SMALL GPUs and the run holds 2; the"
    ):
        on_this_node(fresh, placement, {"CPU-BIG": 3, "CPU-SMALL": 2}, "join request 0")
    big, _ = slots("big-3", "big")
    assert [(s.host, s.tp, s.gpu_ids) for s in big] == [("big-3", 1, (0,))]
    with pytest.raises(HexError, match="big-0 trains in this run"):
        slots("big-0", "big")


def test_a_request_is_answered_only_by_its_own_number(laid_out):
    from areal_hex_plugin.joins import JoinRequest, host_in_use

    ten = PlanChange(
        kind="gained", hosts=["small-2/3"], reason="joined (join request 10), holds version 3", step=4
    )
    why = host_in_use(replace(laid_out, changes=[ten]), [JoinRequest(1, "small", "small-1")], "small-1")
    assert why == "join request 1 for it is not answered yet in the plan's changes"
