"""``HexSession``: what a run is made of, made once and carried to whatever needs it.

One value holds the recipe (the core reader's view, relative paths read from the recipe's folder), upstream's
loaded config, the plan and where it came from, the plan's rewrite of the config, and the live cluster's machines
once read. The pre-flight (``areal/preflight.py``) makes it for the driver and ``areal-hex check``, and opens it
here; the Hex schedulers, ``HexPPOTrainer``, elastic runs and joins take it from :func:`session_for`: the session
opened for their config, else one made from the loaded config (a scheduler or trainer that upstream builds from
``exp_config`` alone). Nothing is written out and read back to get any part of it again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_hex_plugin.areal.rewrite import Rewrite, apply_plan
from areal_hex_plugin.areal.worker_slots import Placement
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.inventory import LiveInventory
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.specs.recipe import Recipe, build_recipe


@dataclass
class HexSession:
    """A run's recipe, upstream config, plan and placement, and what the pre-flight found."""

    recipe: Recipe
    config: Any  # upstream's HexGRPOConfig, rewritten to the plan
    plan: HexPlan  # the running plan: changes made during the run are appended to it
    plan_source: str
    rewrite: Rewrite
    passed: list[str] = field(default_factory=list)  # the pre-flight's checks, one line each, in order
    notes: list[str] = field(default_factory=list)
    inventory: LiveInventory | None = None  # the live cluster, as read once (None: not read)
    announced: bool = False  # what the run decided was printed (areal/startup.py)
    finished: str | None = None  # why the run has nothing left to train (its trial trained every step), if so
    restarts: bool = False  # the driver goes on from a re-plan applied at a checkpoint (areal/auto_replan.py)
    # The driver's way to end the run from another thread (RunGuard.fail); None under upstream's own script.
    end_run: Callable[[HexError], None] | None = None

    @property
    def placement(self) -> Placement:
        return self.rewrite.placement

    def cost_model(self, workload=None):
        """The cost model of the recipe's cluster and calibration (for ``workload``, default the recipe's)."""
        from areal_hex_plugin.costmodel import CostModel

        return CostModel(self.recipe.cluster, workload or self.recipe.workload, self.recipe.calibration)

    def live_inventory(self, source: str) -> LiveInventory:
        """The machines of the live cluster ``source`` (``ray``, ``slurm``, ``local``), read on first use."""
        if self.inventory is None or self.inventory.source != source:
            import os

            from areal_hex_plugin.inventory import read_inventory

            self.inventory = read_inventory(source, os.environ.get("RAY_ADDRESS"))
        return self.inventory


_open: dict[
    int, HexSession
] = {}  # by id(config); each session holds its config, so no id is reused meanwhile


def open_session(session: HexSession) -> HexSession:
    """Make ``session`` the one :func:`session_for` gives for its config."""
    _open[id(session.config)] = session
    return session


def session_for(config, who: str) -> HexSession:
    """The session opened for ``config`` (the pre-flight's), else one made from it now and opened: its recipe
    (relative paths read from the folder of the recipe upstream's loader read), its plan (``hex.plan_path``, or
    solved now) and the plan's rewrite of ``config``. ``who`` names the caller in the error for a config without
    a ``hex:`` section."""
    if getattr(config, "hex", None) is None:
        raise HexError(
            "scheduler",
            f"{who} needs the experiment config with its hex: section (exp_config=...), or a placement",
            "load the recipe with load_expr_config(argv, HexGRPOConfig) and pass exp_config=config (or apply "
            "patches/0005, with which upstream's GRPOConfig takes hex:)",
        )
    found = _open.get(id(config))
    if found is not None and found.config is config:
        return found
    from areal_hex_plugin.saved_plan import obtain_plan

    recipe = recipe_from_config(config, recipe_path(sys.argv))
    plan, source = obtain_plan(recipe, config.hex.plan_path)
    return open_session(HexSession(recipe, config, plan, source, apply_plan(config, plan)))


def recipe_path(argv: list[str]) -> Path:
    """The recipe file upstream's loader read: ``--config PATH`` on the command line, as ``load_expr_config``
    takes it; without one, a recipe in the current directory (relative paths are then read from there)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1]).expanduser().absolute()
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1]).expanduser().absolute()
    return Path.cwd() / "recipe.yaml"


def recipe_from_config(config, path: Path) -> Recipe:
    """The core reader's view of a loaded config (checked as ``areal-hex validate`` checks a recipe file), as the
    recipe at ``path``: relative paths in its ``hex:`` section are read from that file's folder."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.structured(config), resolve=True)
    return build_recipe(data, path, path.parent)
