"""Build dataclasses from plain YAML/JSON data, with errors that name the exact field.

omegaconf's structured merge would do the conversion too, but its errors lose the path inside lists
(``full_key: machines``); this walker keeps ``hex.cluster.pools[1].machines``. By default conversions follow
omegaconf's rules for the types the schemas use (int, float, bool, str, optional, lists and dicts of those or of
dataclasses), as a recipe needs; ``strict`` accepts only values already of the right JSON type (a saved plan).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from areal_hex_plugin.errors import HexError

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


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
    return cls(**{key: _convert(hints[key], value, f"{path}.{key}", strict) for key, value in data.items()})


def _convert(hint: Any, value: Any, path: str, strict: bool) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path, strict)
    if value is None:
        raise HexError(
            path, "must not be empty (null)", "give it a value or remove the key to take the default"
        )
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path, strict)
    if origin is list:
        if not isinstance(value, list):
            raise HexError(path, f"must be a list, got {_describe(value)}", f"write {path} as a YAML list")
        return [_convert(args[0], item, f"{path}[{i}]", strict) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise HexError(
                path, f"must be a mapping, got {_describe(value)}", f"write {path} as 'key: value' lines"
            )
        return {str(k): _convert(args[1], v, f"{path}.{k}", strict) for k, v in value.items()}
    return _scalar(hint, value, path, strict)


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
        if not strict and isinstance(value, str) and value.strip().lstrip("+-").isdigit():
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
    return f"{type(value).__name__} {value!r}"
