"""Tables: rich on a terminal, plain text in a pipe; Slurm host ranges; progress; frontier and per-dollar views."""

from __future__ import annotations

import dataclasses
import io
import time

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.hostlist import compress_hosts
from areal_hex_plugin.plan import ParetoPoint
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.planner.report import describe_plan
from areal_hex_plugin.progress import working
from areal_hex_plugin.specs.recipe import load_recipe
from areal_hex_plugin.tables import render_table
from tests.conftest import REPO

PAPER_7B = REPO / "recipes/paper/7b.yaml"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def plan():
    return plan_recipe(load_recipe(PAPER_7B))


def test_plain_text_in_a_pipe_and_rich_styling_on_a_terminal():
    rows = [["train", 8], ["rollout", 16]]
    plain = render_table(["role", "GPUs"], rows, right=["GPUs"], stream=io.StringIO())
    assert plain.splitlines()[0].split() == ["role", "GPUs"] and "\x1b[" not in plain and plain.isascii()
    assert plain.splitlines()[2].endswith(" 8") and plain.splitlines()[3].endswith("16")  # right-aligned
    styled = render_table(["role", "GPUs"], rows, stream=_Terminal())
    assert "\x1b[1m" in styled and "─" in styled  # bold header, rich rule


@pytest.mark.parametrize(
    ("hosts", "written"),
    [
        ([f"h100-{i}" for i in range(57)], "h100-[0-56]"),
        (["h20-0", "h20-1", "h20-3", "h20-5", "h20-6", "h20-7"], "h20-[0-1,3,5-7]"),
        (["node001", "node002", "node010"], "node[001-002,010]"),
        (["gpu-b", "h800-2"], "gpu-b,h800-2"),
        ([], ""),
    ],
)
def test_host_lists_are_compressed_as_slurm_writes_them(hosts, written):
    assert compress_hosts(hosts) == written


def test_the_hosts_column_stays_narrow_at_scale():
    plan = plan_recipe(load_recipe(PAPER_7B, ["hex.cluster.pools.1.machines=256"]))
    text = describe_plan(plan)
    assert max(len(line) for line in text.splitlines()[:12]) < 200
    idle = next(line for line in text.splitlines() if line.startswith("idle") and " h20 " in line)
    assert "h20-[" in idle and ", h20-" not in idle


def test_progress_shows_on_a_terminal_and_in_a_log_for_long_work_only(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with working("quick", after_s=1.0):
        pass
    assert terminal.getvalue() == ""
    with working("solving", after_s=0.05):
        time.sleep(0.5)
    assert "solving" in terminal.getvalue()
    piped = io.StringIO()  # a pipe or a log: a line once the work is long, one a while, one when it ends
    monkeypatch.setattr("sys.stderr", piped)
    with working("quick", after_s=1.0):
        pass
    assert piped.getvalue() == ""
    with working("solving", after_s=0.0, every_s=0.05):
        time.sleep(0.2)
    lines = piped.getvalue().splitlines()
    assert lines[0] == "solving ..." and lines[1].startswith("solving ... ")
    assert lines[-1].startswith("solving: done in ")


def test_the_chosen_plan_is_compared_per_dollar_too(plan):
    base = next(iter(plan.baselines))
    cheap = dataclasses.replace(
        plan.baselines[base],
        tokens_per_s=plan.predicted.tokens_per_s / 2,
        cost_per_hour=plan.predicted.cost_per_hour / 4,  # half the speed at a quarter of the price
    )
    text = describe_plan(dataclasses.replace(plan, baselines={base: cheap}))
    header = next(line for line in text.splitlines() if line.startswith("plan "))
    assert "chosen is: tok/s" in header and "chosen is: tok/$" in header
    row = next(line for line in text.splitlines() if line.startswith(base))
    assert "2.00x" in row and "0.50x" in row  # twice as fast, half as good per dollar


def test_pareto_prints_its_frontier_as_a_table(plan):
    p = plan.predicted
    points = [
        ParetoPoint(p.cost_per_hour / 2, p.tokens_per_s / 3, {"H20": 8}),
        ParetoPoint(p.cost_per_hour, p.tokens_per_s, {"H20": 16, "H800-PCIe": 16}),
    ]
    lines = describe_plan(dataclasses.replace(plan, pareto=points)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Pareto frontier (2 points"))
    assert lines[start + 1].split() == ["$/h", "tokens/s", "tokens/$", "GPUs", "note"]
    assert "8 H20" in lines[start + 3] and "chosen" in lines[start + 4].split("H800-PCIe")[-1]


@pytest.mark.slow
def test_the_planners_frontier_only_grows(capsys):
    assert main(["plan", str(PAPER_7B), "--pareto"]) == 0
    out = capsys.readouterr().out
    rows = out.split("Pareto frontier")[1].split("\n\n")[0].splitlines()[3:]
    costs = [float(r.split()[0].replace(",", "")) for r in rows]
    rates = [float(r.split()[1].replace(",", "")) for r in rows]
    assert len(rows) >= 3 and costs == sorted(costs)
    assert all(b > a * 1.001 for a, b in zip(rates, rates[1:], strict=False))  # no point repeats or stalls
