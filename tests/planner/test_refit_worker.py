"""The online refit's worker process (planner/refit_worker.py): CPU seconds counted over every thread, the job run
in a niced process of its own that loads no torch, a worker that dies failing only the job in hand, and none left
after stop."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from ortools.sat.python import cp_model

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.costmodel.refit import MeasurementWindow, ServerSample, StepSample, server_tokens_per_s
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.planner.cpsat import solve_model
from areal_hex_plugin.planner.refit_replan import plan_layout
from areal_hex_plugin.planner.refit_worker import (
    NICE,
    RefitJob,
    RefitWorker,
    WorkerDied,
    cpu_timed,
    one_solver_worker,
)
from areal_hex_plugin.sim.online import read_truth
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO

TINY = REPO / "recipes" / "ci" / "tiny.yaml"
TRUTH = REPO / "recipes" / "ci" / "tiny-truth.json"  # every factor of CPU-SMALL 30% worse than believed


@pytest.fixture(scope="module")
def job():
    """The tiny recipe (its re-solve asking for 4 CP-SAT workers) and a refit job of six steps served at the
    true model's speeds."""
    recipe = load_recipe(TINY, ["hex.solver.num_workers=4"])
    plan = plan_recipe(recipe)
    cm = CostModel(recipe.cluster, recipe.workload, read_truth(str(TRUTH), recipe))
    layout = plan_layout(plan, recipe.hex.transport)
    window = MeasurementWindow()
    shapes = [(g.pool, g.tp, g.pp, g.concurrency) for g in plan.rollout.replicas for _ in range(g.count)]
    for _ in range(6):
        servers = tuple(
            ServerSample(p, tp, pp, c, server_tokens_per_s(cm, (p, tp, pp), c)) for p, tp, pp, c in shapes
        )
        window.add(StepSample(servers, layout.train_s(cm), layout.sync_s(cm)))
    return recipe, RefitJob(recipe, "t1", 0.05, plan, recipe.calibration, window.measured(), 6)


def _process_cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, every thread's (utime + stime of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_cpu_seconds_include_the_threads_a_part_hands_its_work_to() -> None:
    """A CP-SAT solve with two workers does its work on CP-SAT's threads, not the caller's: the CPU seconds
    reported for it are the process's, which a thread's own clock misses."""
    model = cp_model.CpModel()
    xs = [model.new_int_var(0, 29, f"x{i}") for i in range(30)]
    for shift in (0, 1, -1):
        model.add_all_different([x + shift * i for i, x in enumerate(xs)])
    model.maximize(sum((i % 7) * x for i, x in enumerate(xs)))
    mine = time.thread_time()
    _, cpu = cpu_timed(lambda: solve_model(model, 0.1, 2, 0))
    mine = time.thread_time() - mine
    assert cpu > 0.05 and cpu > 3 * mine, (cpu, mine)


def test_a_live_resolve_takes_one_cpsat_worker(job) -> None:
    recipe, _ = job
    assert recipe.hex.solver.num_workers == 4 and one_solver_worker(recipe).hex.solver.num_workers == 1


def test_the_job_runs_in_a_niced_process_of_its_own_that_loads_no_torch_and_reports_its_cpu(
    job, refit_worker
) -> None:
    _, refit_job = job
    first = refit_worker.run(refit_job)
    pid = refit_worker.pid
    assert pid != os.getpid() and first.why is None and first.decision is not None
    assert os.getpriority(os.PRIO_PROCESS, pid) >= min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICE)
    assert "torch" not in Path(f"/proc/{pid}/maps").read_text()
    before = _process_cpu_s(pid)
    second = refit_worker.run(refit_job)  # the same worker, its imports done: its CPU is the job's
    spent = _process_cpu_s(pid) - before
    assert refit_worker.pid == pid
    reported = second.cpu_s + second.decision_cpu_s
    assert 0 < second.cpu_s < 1.0 and 0 < second.decision_cpu_s < 2.0
    assert 0.8 * spent - 0.03 <= reported <= spent + 0.03, (reported, spent)


def test_a_worker_that_dies_fails_its_job_the_next_job_starts_a_new_one_and_stop_ends_it(job) -> None:
    _, refit_job = job
    worker = RefitWorker()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(refit_job)
        except WorkerDied as error:
            failed.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while worker.pid is None and time.monotonic() < deadline:
        time.sleep(0.01)
    dead = worker.pid
    os.kill(dead, signal.SIGKILL)  # still importing the core: the job cannot have been answered
    thread.join(30)
    (error,) = failed
    assert f"pid {dead}" in str(error) and "exit code -9" in str(error)
    try:
        outcome = worker.run(refit_job)
        assert worker.pid not in (None, dead) and outcome.why is None
    finally:
        live = worker.pid
        worker.stop()
    assert worker.pid is None and not any(Path(f"/proc/{pid}").exists() for pid in (dead, live))  # reaped
