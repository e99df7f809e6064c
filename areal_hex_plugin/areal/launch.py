"""Choose and build the Hex scheduler for ``scheduler.type`` from the run's session.

Each scheduler checks the plan against its live cluster when it is set up, before any worker starts, so a plan
that does not fit stops the run with one clear :class:`HexError` and nothing is left running.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from areal_hex_plugin.areal.plugin import SCHEDULERS, load, register
from areal_hex_plugin.errors import HexError

UPSTREAM_SCHEDULERS = ("local", "ray", "slurm")


def check_scheduler_type(kind: str | None) -> None:
    """``kind`` must be a scheduler :func:`register` installed (``hex_local``, ``hex_ray``, ``hex_slurm``)."""
    register()
    if kind not in SCHEDULERS:
        raise HexError(
            "scheduler.type",
            f"unknown scheduler type {kind!r} for a hex run",
            f"use one of {', '.join(SCHEDULERS)} (or {', '.join(UPSTREAM_SCHEDULERS)} with upstream's own "
            "script, which ignores the plan)",
        )


def scheduler_factory(session) -> Callable[[], object]:
    """Set up the scheduler of ``scheduler.type`` for ``session`` (its checks against the live cluster run now)
    and return a builder for it (the class :func:`register` installed under that name)."""
    kind = session.config.scheduler.type
    check_scheduler_type(kind)
    scheduler_cls = load(SCHEDULERS[kind])
    return functools.partial(scheduler_cls, exp_config=session.config, **scheduler_cls.setup(session))
