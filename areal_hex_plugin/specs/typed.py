"""Build dataclasses from plain YAML/JSON data, with errors that name the exact field.

omegaconf's structured merge would do the conversion too, but its errors lose the path inside lists
(``full_key: machines``); this walker keeps ``hex.cluster.pools[1].machines``. By default conversions follow
omegaconf's rules for the types the schemas use (int, float, bool, str, optional, lists and dicts of those or of
dataclasses), as a recipe needs; ``strict`` accepts only values already of the right JSON type (a saved plan).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from areal_hex_plugin.errors import HexError

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
# The longest string any field takes: longer is a mistake (a plan's sentences on 4,096 machines stay far below).
MAX_CHARS = 65_536


@dataclass(frozen=True)
class Range:
    """The values a number may take: ``low`` to ``high`` inclusive, or above ``low`` when ``open_low``."""

    low: float
    high: float
    open_low: bool = False
    unit: str = ""

    def __contains__(self, value: float) -> bool:
        return (self.low < value if self.open_low else self.low <= value) and value <= self.high

    def __str__(self) -> str:
        low, high = (f"{v:,}" if isinstance(v, int) else f"{v:g}" for v in (self.low, self.high))
        return f"{'(' if self.open_low else '['}{low}, {high}]" + (f" {self.unit}" if self.unit else "")


def spec(
    default: Any = dataclasses.MISSING,
    help: str = "",
    range: Range | None = None,
    choices: tuple[str, ...] = (),
    default_factory: Any = dataclasses.MISSING,
    max_items: int | None = None,
) -> Any:
    """A dataclass field with its help, sane range (of a number, or of each number in a list), choices and most
    list items in ``metadata`` (checked by :func:`build`)."""
    metadata = {"help": help, "range": range, "choices": choices, "max_items": max_items}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def between(low: float, high: float, unit: str = "") -> Range:
    return Range(low, high, False, unit)


def above(low: float, high: float, unit: str = "") -> Range:
    return Range(low, high, True, unit)


def meta_of(cls: type, name: str) -> Any:
    """The metadata (help, range, choices) of field ``name`` of dataclass ``cls``, to check a value that
    enters elsewhere (a command-line flag) by the same rule."""
    return cls.__dataclass_fields__[name].metadata


def build(cls: type, data: Any, path: str, strict: bool = False) -> Any:
    """An instance of dataclass ``cls`` from ``data`` (a mapping), defaults filling the gaps."""
    if data is None and not strict:
        data = {}
    if not isinstance(data, dict):
        raise HexError(
            path, f"must be a mapping, got {_describe(data)}", f"write {path} as 'key: value' lines"
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise HexError(f"{path}.{key}", "unknown key", f"{hint}known keys: {', '.join(names)}")
    for f in dataclasses.fields(cls):
        if (
            f.name not in data
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            raise HexError(f"{path}.{f.name}", "is missing", f"give {path}.{f.name}")
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}
    return cls(
        **{
            key: _convert(hints[key], value, f"{path}.{key}", strict, meta[key])
            for key, value in data.items()
        }
    )


def _convert(hint: Any, value: Any, path: str, strict: bool, meta: Any = None) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path, strict, meta)
    if value is None:
        raise HexError(
            path, "must not be empty (null)", "give it a value or remove the key to take the default"
        )
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path, strict)
    if origin is list:
        if not isinstance(value, list):
            raise HexError(path, f"must be a list, got {_describe(value)}", f"write {path} as a YAML list")
        most = (meta or {}).get("max_items")
        if most is not None and len(value) > most:
            raise HexError(path, f"has {len(value):,} entries, more than {most:,}", f"give at most {most:,}")
        return [_convert(args[0], item, f"{path}[{i}]", strict, meta) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise HexError(
                path, f"must be a mapping, got {_describe(value)}", f"write {path} as 'key: value' lines"
            )
        return {str(k): _convert(args[1], v, _key(k, path), strict, meta) for k, v in value.items()}
    return scalar(hint, value, path, meta or {}, strict)


def _key(key: Any, path: str) -> str:
    if len(str(key)) > MAX_CHARS:
        raise HexError(path, f"has a key of {len(str(key)):,} characters", f"keep keys under {MAX_CHARS}")
    return f"{path}.{key}"


def scalar(hint: type, value: Any, path: str, meta: Any = None, strict: bool = False) -> Any:
    """``value`` as a ``hint`` (bool, int, float or str), checked against the field's ``meta``data."""
    checked = _scalar(hint, value, path, strict)
    _check_meta(checked, path, meta or {})
    return checked


def _check_meta(value: Any, path: str, meta: Any) -> None:
    what = f" ({meta['help']})" if meta.get("help") else ""
    if isinstance(value, str):
        choices = meta.get("choices")
        if choices and value not in choices:
            raise HexError(path, f"unknown value {value!r}", f"use one of {', '.join(choices)}")
        if len(value) > MAX_CHARS:
            raise HexError(
                path, f"is {len(value):,} characters long", f"give at most {MAX_CHARS} characters{what}"
            )
        return
    if isinstance(value, bool):
        return
    kind = "a whole number" if isinstance(value, int) else "a number"
    if isinstance(value, float) and not math.isfinite(value):
        raise HexError(path, f"must be a finite number, got {value}", f"set {path} to {kind}{what}")
    allowed = meta.get("range")
    if allowed is not None and value not in allowed:
        raise HexError(path, f"must be {kind} in {allowed}, got {value!r}", f"set {path} in that range{what}")


def _scalar(hint: type, value: Any, path: str, strict: bool = False) -> Any:
    if isinstance(value, dict | list):
        raise HexError(path, f"must be a single {hint.__name__}, got {_describe(value)}", "give one value")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if not strict and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if not strict and isinstance(value, str) and value.strip().lstrip("+-").isdigit() and len(value) < 30:
            return int(value)
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if not strict and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif (
        hint is str
        and isinstance(value, str if strict else str | int | float)
        and not isinstance(value, bool)
    ):
        return str(value)
    kind = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}[hint]
    raise HexError(path, f"must be {kind}, got {_describe(value)}", f"set {path} to {kind}")


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"
