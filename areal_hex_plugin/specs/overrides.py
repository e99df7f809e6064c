"""Command-line overrides in Hydra's own grammar (``a.b=c``, ``+a.b=c``, ``++a.b=c``, ``~a.b``), as upstream
AReaL takes them, applied to a recipe with one clear error per bad key."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.schema_keys import KeyCheck, check_key

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


def hex_keys(key: str) -> KeyCheck:
    """The schema the core knows: the ``hex:`` section (:class:`HexConfig`); upstream's keys it cannot tell."""
    from areal_hex_plugin.specs.config import HexConfig

    head, _, rest = key.partition(".")
    if head != "hex" or not rest:
        return KeyCheck(None)
    check = check_key(HexConfig, rest)
    return KeyCheck(check.known, check.meant and f"hex.{check.meant}")


def checked_overrides(overrides: list[str], keys: Callable[[str], KeyCheck] = hex_keys) -> list[str]:
    """``overrides`` with every key the schema ``keys`` knows written ``++key=value`` (set it, whether or not
    the recipe has it: the config class gives every field a default, so ``hex.dry_run=true`` needs no ``+``);
    a key the schema lacks is refused, naming the key meant."""
    out = []
    for item in overrides:
        override = _parse(item)
        if override.type == OverrideType.DEL:
            out.append(item)
            continue
        key, text = override.key_or_group, item.split("=", 1)[1]
        check = keys(key)
        if check.known is False:
            fix = (
                f"did you mean {check.meant}? write {check.meant}={text}"
                if check.meant
                else "check its spelling"
            )
            raise HexError(key, f"is not a key of the config (override {item!r})", fix)
        out.append(f"++{key}={text}" if check.known else item)
    return out


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
    """``config`` with ``overrides`` applied (:func:`checked_overrides` first) and interpolations resolved
    (plain containers)."""
    cfg = OmegaConf.create(config)
    for given, item in zip(overrides, checked_overrides(overrides), strict=True):
        _apply(cfg, given, _parse(item))
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise HexError(
            "recipe",
            f"cannot resolve an interpolation: {str(exc).splitlines()[0]}",
            "fix the ${...} reference",
        ) from None
