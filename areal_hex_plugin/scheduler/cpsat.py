"""The one place CP-SAT solver settings are chosen, so every model is solved the same deterministic way."""

from __future__ import annotations

import math

from ortools.sat.python import cp_model


def solve_model(
    model: cp_model.CpModel, time_limit_s: float, num_workers: int, seed: int
) -> tuple[cp_model.CpSolver, int]:
    """Solve with explicit settings: fixed seed and worker count, and a hard time limit."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = num_workers
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    solver.parameters.random_seed = seed
    return solver, solver.solve(model)


def found(status: int) -> bool:
    return status in (cp_model.OPTIMAL, cp_model.FEASIBLE)


def budget_cents(budget_per_hour: float) -> int:
    """A $/h budget in whole cents, robust to binary fractions (32.16 * 100 is 3215.9999...)."""
    return math.floor(budget_per_hour * 100 + 1e-6)
