"""``register()``: the one way the plugin hooks into upstream AReaL, for the driver and for a user's own script.

Declared as the ``areal.plugins: hex`` entry point and called first by the driver and by ``HexPPOTrainer``.
It fills the tables below, each item only if missing, once per process (a module flag):

- ``SCHEDULERS``: ``scheduler.type`` -> scheduler class. ``HexPPOTrainer._init_scheduler`` reads it. With
  ``patches/0004`` applied they also go into upstream's scheduler registry (``areal.api.plugins``), whose loader
  calls this function through the entry point, so upstream's own trainers accept ``scheduler.type: hex_local``;
  with ``patches/0001`` they take a Hex scheduler's class path. Either way upstream builds it with ``exp_config=``
  alone, which every Hex scheduler accepts.
- ``ROLLOUT_ENGINES``: rollout backend -> engine class. ``HexPPOTrainer._rollout_engine_cls`` reads it: upstream
  calls that method itself with ``patches/0002``; without it, ``_init_rollout`` swaps the engine class in for the
  call (:func:`swapped`).
- ``TRAIN_ENGINES``: (``hex.transport``, actor backend) -> train engine class; ``HexPPOTrainer`` builds the actor
  with it. With ``patches/0003`` the relay also goes into upstream's weight-transport registry as ``hex_relay``
  (``transport/registry.py``, built by ``areal/transport_setup.py``), so upstream's own trainer and FSDP actor run it with
  ``actor.weight_update_mode: hex_relay``.
- The ``hex:`` config section (``HexConfig``): with ``patches/0005`` it goes into upstream's config-section registry
  (``areal.api.plugins.register_config_section``), so upstream's ``load_expr_config(argv, GRPOConfig)`` loads a
  recipe's ``hex:`` and the Hex schedulers find it in the ``exp_config`` upstream builds them with.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

HEX_SCHEDULERS = {
    "hex_local": "areal_hex_plugin.areal.schedulers.local.HexLocalScheduler",
    "hex_ray": "areal_hex_plugin.areal.schedulers.ray.HexRayScheduler",
    "hex_slurm": "areal_hex_plugin.areal.schedulers.slurm.HexSlurmScheduler",
}
HEX_WEIGHT_TRANSPORT = "areal_hex_plugin.areal.transport_setup.relay_weight_transport"
HEX_ROLLOUT_ENGINES = {"sglang": "areal_hex_plugin.areal.engines.HexRemoteSGLangEngine"}
HEX_TRAIN_ENGINES = {
    ("relay", "fsdp"): "areal_hex_plugin.transport.fsdp_adapter.HexFSDPPPOActor",
    # The plan's per-stage layer counts (upstream's own weight-update paths).
    ("upstream", "megatron"): "areal_hex_plugin.areal.megatron_actor.HexMegatronPPOActor",
    ("relay", "megatron"): "areal_hex_plugin.areal.megatron_actor.HexMegatronRelayActor",
}

SCHEDULERS: dict[str, str] = {}
ROLLOUT_ENGINES: dict[str, str] = {}
TRAIN_ENGINES: dict[tuple[str, str], str] = {}

_registered = False
_swap_lock = threading.Lock()


def register() -> None:
    """Install the Hex schedulers, rollout engine and relay transport; a second call changes nothing."""
    global _registered
    if _registered:
        return
    _registered = True
    for table, items in (
        (SCHEDULERS, HEX_SCHEDULERS),
        (ROLLOUT_ENGINES, HEX_ROLLOUT_ENGINES),
        (TRAIN_ENGINES, HEX_TRAIN_ENGINES),
    ):
        for key, path in items.items():
            table.setdefault(key, path)
    _register_upstream_schedulers()
    _register_upstream_transport()
    _register_upstream_config_section()


def _register_upstream_schedulers() -> None:
    """Into upstream's scheduler registry, where the installed AReaL has one (``patches/0004``)."""
    import importlib.util

    if importlib.util.find_spec("areal.api.plugins") is None:
        return
    from areal.api import plugins

    for name, path in SCHEDULERS.items():
        if plugins.get_scheduler(name) is None:
            plugins.register_scheduler(name, functools.partial(_build, path))


def _register_upstream_transport() -> None:
    """The relay into upstream's weight-transport registry, where the installed AReaL has one (``patches/0003``)."""
    import importlib.util

    if importlib.util.find_spec("areal.api.weight_transport") is None:
        return
    from areal.api import weight_transport

    from areal_hex_plugin.transport.registry import NAME

    try:
        weight_transport.get_weight_transport(NAME)
    except ValueError:  # not registered yet
        weight_transport.register_weight_transport(NAME, load(HEX_WEIGHT_TRANSPORT)())


def _register_upstream_config_section() -> None:
    """``hex:`` into upstream's config-section registry, where the installed AReaL has one (``patches/0005``)."""
    import importlib.util

    if importlib.util.find_spec("areal.api.plugins") is None:
        return
    from areal.api import plugins

    if hasattr(plugins, "register_config_section"):
        from areal_hex_plugin.specs.config import HexConfig

        plugins.register_config_section("hex", HexConfig)


def _build(path: str, **kwargs: Any) -> Any:
    return load(path)(**kwargs)


def load(path: str) -> Any:
    """The class at an import path (``pkg.module.Name``)."""
    from areal.utils.dynamic_import import import_from_string

    return import_from_string(path)


@contextmanager
def swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside the block (one swap at a time), the original again after it.

    The stand-in for an upstream hook that the installed AReaL lacks (see ``patches/``)."""
    with _swap_lock:
        original = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, original)
