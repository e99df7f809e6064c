"""The one place CP-SAT solver settings are chosen, so every model is solved the same deterministic way; and the
search's clock, which counts work, not seconds."""

from __future__ import annotations

import math

from ortools.sat.python import cp_model

# Work one solve may do, in CP-SAT's deterministic time units (about a second of one core): a solve stops on
# this, not on the machine's load, so the same recipe gets the same plan on a busy machine and an idle one.
DETERMINISTIC_LIMIT = 1.0
# Wall seconds after which a solve stops whatever its work: a backstop, never reached by a healthy solve.
WALL_BACKSTOP_S = 600.0


class Model(cp_model.CpModel):
    """A CP-SAT model without the camelCase aliases ortools 9 binds on every model it builds (``AddBoolOr`` for
    ``add_bool_or``, ...): binding them looks up every method of the model, about 0.4 ms a model, 5% of
    ``areal-hex reproduce``; the planner calls the PEP 8 names only. The model itself (its proto) is the same."""

    def _add_pre_pep8_methods(self) -> None:
        pass


def solve_model(
    model: cp_model.CpModel, work_limit: float, num_workers: int, seed: int
) -> tuple[cp_model.CpSolver, int]:
    """Solve with explicit settings: fixed seed and worker count (one worker is deterministic; CP-SAT's parallel
    workers race), at most ``work_limit`` (the search's work left, at most DETERMINISTIC_LIMIT) of deterministic
    time, and a wall-clock limit only as a backstop far beyond it; the work done goes on the search's clock."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = num_workers
    solver.parameters.max_deterministic_time = deterministic_limit(work_limit)
    solver.parameters.max_time_in_seconds = WALL_BACKSTOP_S
    solver.parameters.random_seed = seed
    status = solver.solve(model)
    charge(solver.deterministic_time)
    return solver, status


def deterministic_limit(work_limit: float) -> float:
    """The deterministic time a solve may use where the search has ``work_limit`` of work left."""
    return max(0.01, min(DETERMINISTIC_LIMIT, work_limit))


def found(status: int) -> bool:
    return status in (cp_model.OPTIMAL, cp_model.FEASIBLE)


def budget_cents(budget_per_hour: float) -> int:
    """A $/h budget in whole cents, robust to binary fractions (32.16 * 100 is 3215.9999...)."""
    return math.floor(budget_per_hour * 100 + 1e-6)


# Work done by the planner's searches in this process, in about seconds of one core of the machine the charges
# were measured on (planner/evaluate.py, inflight.py): CP-SAT's deterministic time and a fixed charge per
# cost-model estimate and per runtime choice scored.
_work = [0.0]


def charge(units: float) -> None:
    """Count ``units`` of work on the search's clock."""
    _work[0] += units


def clock() -> float:
    """The search's clock: the work counted so far (:func:`charge`), never seconds, so time limits stop a search
    at the same point on any machine, however fast or busy, and the plan depends on the recipe alone."""
    return _work[0]
