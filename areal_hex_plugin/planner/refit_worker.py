"""The online refit's own process (``areal/refit_loop.py``): each refit of the cost model and its re-plan decision
run in a long-lived worker process beside the trainer, never in the trainer's process, so neither takes a core
nor the GIL from a training step.

The worker is a ``spawn`` process that imports only the core (costmodel, planner), runs at lowered priority
(``NICE`` above the trainer's, from its start) so the trainer's processes win the cores, and re-solves with one
CP-SAT worker whatever the recipe's ``hex.solver.num_workers``. It runs one :class:`RefitJob` at a time (:func:`run_job`); the CPU seconds
it reports for a refit and for a decision are its whole process's (every thread: CP-SAT's, numpy's), taken
around each. A worker that dies (or cannot be reached) fails the job in hand with :class:`WorkerDied`; the next
job starts a new one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.costmodel.refit import Measured, Refit, diverged, refit
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.planner.refit_replan import Decision, decide, plan_layout
from areal_hex_plugin.specs.recipe import Recipe

# The worker's niceness: a refit waits for the cores rather than a training step.
NICE = 10
T = TypeVar("T")
# Seconds a worker asked to stop may take to leave before it is killed.
STOP_S = 5.0


class WorkerDied(RuntimeError):
    """The worker process ended (or could not be reached) before it answered."""


@dataclass(frozen=True)
class RefitJob:
    """One refit of a run (``run`` names it in the refit's sources) of ``recipe``, re-planning above
    ``threshold``: the running plan, the model the run believes now, the window's medians, the step."""

    recipe: Recipe
    run: str
    threshold: float
    plan: HexPlan
    calibration: Calibration
    measured: Measured
    step: int


@dataclass(frozen=True)
class RefitOutcome:
    """A job's result: the fit (None where it raised), why it is not trusted (None: accepted), its CPU seconds;
    for an accepted fit, the re-plan decision (None where it raised, ``no_decision`` saying why) and its CPU
    seconds."""

    fit: Refit | None
    why: str | None
    cpu_s: float
    decision: Decision | None = None
    no_decision: str | None = None
    decision_cpu_s: float = 0.0


def cpu_timed(part: Callable[[], T]) -> tuple[T, float]:
    """``part()`` and the CPU seconds this process spent meanwhile, every thread's (CP-SAT's workers, numpy's):
    a thread's own clock misses the work it hands to others."""
    started = time.process_time()
    return part(), time.process_time() - started


def _refit(job: RefitJob) -> tuple[Refit | None, str | None]:
    recipe = job.recipe
    try:
        cm = CostModel(recipe.cluster, recipe.workload, job.calibration)
        layout = plan_layout(job.plan, recipe.hex.transport)
        fit = refit(cm, layout, job.measured, job.run, prior=recipe.calibration)
        return fit, diverged(fit)
    except Exception as error:
        return None, f"the refit failed ({type(error).__name__}: {error})"


def _decide(job: RefitJob, fit: Refit) -> Decision | str:
    try:
        return decide(job.recipe, job.plan, fit.calibration, job.threshold, job.step)
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def run_job(job: RefitJob) -> RefitOutcome:
    """Refit the recipe's model to ``job``'s measurements (the recipe's calibration the prior) and, where the fit
    is trusted, decide whether to re-plan, each timed by :func:`cpu_timed`."""
    (fit, why), cpu = cpu_timed(lambda: _refit(job))
    if fit is None or why is not None:
        return RefitOutcome(fit, why, cpu)
    decision, decision_cpu = cpu_timed(lambda: _decide(job, fit))
    if isinstance(decision, str):
        return RefitOutcome(fit, None, cpu, no_decision=decision, decision_cpu_s=decision_cpu)
    return RefitOutcome(fit, None, cpu, decision, decision_cpu_s=decision_cpu)


def one_solver_worker(recipe: Recipe) -> Recipe:
    """``recipe`` with ``hex.solver.num_workers`` 1: a live re-solve takes one core at most."""
    return replace(recipe, hex=replace(recipe.hex, solver=replace(recipe.hex.solver, num_workers=1)))


def _serve(conn) -> None:
    """The worker process: jobs in, outcomes out, until None or the trainer's end of the pipe closes."""
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        conn.send(run_job(replace(job, recipe=one_solver_worker(job.recipe))))


class RefitWorker:
    """The worker process of one run (see the module doc): started by the first job and again by the first
    after one died; :meth:`stop` ends it."""

    def __init__(self) -> None:
        self._process = None
        self._conn = None
        self._lock = threading.Lock()  # the process and its pipe
        self._job = threading.Lock()  # one job at a time

    @property
    def pid(self) -> int | None:
        """The worker's process id (None before the first job)."""
        return None if self._process is None else self._process.pid

    def run(self, job: RefitJob) -> RefitOutcome:
        """``job``'s outcome, computed in the worker (this thread only waits); :class:`WorkerDied` where the
        worker ends first. Jobs from several threads run one after another."""
        with self._job:
            process, conn = self._started()
            try:
                conn.send(job)
                return conn.recv()
            except (EOFError, OSError) as error:
                process.join(STOP_S)
                self._forget(process)
                raise WorkerDied(
                    f"the refit worker (pid {process.pid}) ended before it answered (exit code "
                    f"{process.exitcode}, {type(error).__name__})"
                ) from None

    def stop(self) -> None:
        """End the worker: asked first, killed after ``STOP_S`` (a job in hand fails)."""
        with self._lock:
            process, conn = self._process, self._conn
        if process is None:
            return
        with contextlib.suppress(OSError):  # a worker already gone
            conn.send(None)
        process.join(STOP_S)
        if process.is_alive():
            process.kill()
            process.join()
        self._forget(process)

    def _started(self):
        with self._lock:
            if self._process is None or not self._process.is_alive():
                if self._conn is not None:
                    self._conn.close()
                context = multiprocessing.get_context("spawn")
                mine, theirs = context.Pipe()
                self._process = context.Process(target=_serve, args=(theirs,), name="hex-refit", daemon=True)
                self._process.start()
                # Niced from here, before it imports the core (a second of CPU), not after.
                niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICE)
                os.setpriority(os.PRIO_PROCESS, self._process.pid, niceness)
                theirs.close()  # so a worker that dies reads as the end of the pipe
                self._conn = mine
            return self._process, self._conn

    def _forget(self, process) -> None:
        with self._lock:
            if self._process is process:
                self._conn.close()
                self._process, self._conn = None, None
