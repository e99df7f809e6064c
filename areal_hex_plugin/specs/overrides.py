"""Command-line overrides in Hydra's own grammar (``a.b=c``, ``+a.b=c``, ``++a.b=c``, ``~a.b``), as upstream
AReaL takes them, applied to a recipe with one clear error per bad key."""

from __future__ import annotations

import re
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_hex_plugin.errors import HexError

_ABSENT = object()
GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def _parse(item: str) -> Override:
    if "=" not in item and not item.startswith("~"):
        raise HexError(
            f"override {item!r}", "is not key=value", "write overrides as key=value, e.g. hex.routing=shares"
        )
    if item.lstrip("+~").startswith("="):
        raise HexError(f"override {item!r}", "has no key", "write overrides as key=value")
    try:
        (override,) = OverridesParser.create().parse_overrides([item])
    except HydraException as exc:
        problem = str(exc).splitlines()[0]
        key, _, text = item.partition("=")
        # Error messages name list items as pools[1]; Hydra's keys write them as pools.1.
        dotted = re.sub(r"\[(\d+)\]", r".\1", key)
        fix = f"write {dotted}={text} (Hydra names list items by .N)" if dotted != key else GRAMMAR
        raise HexError(f"override {item!r}", f"is not Hydra override syntax ({problem})", fix) from None
    if override.is_sweep_override():
        raise HexError(
            f"override {item!r}", "is a sweep (several values)", "give one value: areal-hex plans one recipe"
        )
    if override.package is not None:
        raise HexError(f"override {item!r}", "sets a config-group package (@)", "write key=value")
    return override


def _apply(cfg: Any, item: str, override: Override) -> None:
    key = override.key_or_group
    value = override.value()
    exists = OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT
    if override.type == OverrideType.DEL:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if node is None or not exists:
            raise HexError(f"override {item!r}", f"there is no {key!r} to delete", "check the key's spelling")
        if value is not None and OmegaConf.select(cfg, key) != value:
            raise HexError(
                f"override {item!r}",
                f"{key} is {OmegaConf.select(cfg, key)!r}, not {value!r}",
                f"write ~{key} to delete it whatever its value",
            )
        del node[leaf]
        return
    text = item.split("=", 1)[1]
    if override.type == OverrideType.ADD and exists:
        raise HexError(f"override {item!r}", f"{key} is already in the recipe", f"write {key}={text}")
    if override.type == OverrideType.CHANGE and not exists:
        raise HexError(f"override {item!r}", f"{key} is not in the recipe", f"write +{key}={text} to add it")
    try:
        OmegaConf.update(cfg, key, value, force_add=True)
    except OmegaConfBaseException as exc:
        raise HexError(f"override {item!r}", str(exc).splitlines()[0], "check the key path") from None


def apply_overrides(config: dict, overrides: list[str]) -> dict:
    """``config`` with ``overrides`` applied and interpolations resolved (plain containers)."""
    cfg = OmegaConf.create(config)
    for item in overrides:
        _apply(cfg, item, _parse(item))
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise HexError(
            "recipe",
            f"cannot resolve an interpolation: {str(exc).splitlines()[0]}",
            "fix the ${...} reference",
        ) from None
