"""JSON Schemas of every JSON file areal-hex writes, shipped with the package.

``plan.schema.json`` is generated from the :class:`~areal_hex_plugin.plan.HexPlan` dataclasses (their help, ranges
and choices) by ``python -m areal_hex_plugin.schemas``; the others are written by hand. Each document carries a
``schema_version`` (the trace: ``otherData.schema_version``; a profile: its ``format``) that its schema pins.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from functools import cache
from importlib import resources
from typing import Any

NAMES = ("plan", "estimate", "simulate", "reproduce", "trace", "catalog", "profile", "calibrate")
DIALECT = "https://json-schema.org/draft/2020-12/schema"


@cache
def load_schema(name: str) -> dict[str, Any]:
    """The shipped schema ``<name>.schema.json`` (``name`` in :data:`NAMES`)."""
    return json.loads(resources.files(__name__).joinpath(f"{name}.schema.json").read_text())


def _field_schema(hint: Any, meta: typing.Mapping[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_field_schema(a, meta, defs) for a in args if a is not type(None)]
        return {"anyOf": [*options, {"type": "null"}]} if type(None) in args else {"anyOf": options}
    if origin is list:
        out = {"type": "array", "items": _field_schema(args[0], meta, defs)}
        return out | ({"maxItems": meta["max_items"]} if meta.get("max_items") else {})
    if origin is dict:
        return {"type": "object", "additionalProperties": _field_schema(args[1], meta, defs)}
    if dataclasses.is_dataclass(hint):
        _definition(hint, defs)
        return {"$ref": f"#/$defs/{hint.__name__}"}
    out: dict[str, Any] = {
        str: {"type": "string"},
        bool: {"type": "boolean"},
        int: {"type": "integer"},
        float: {"type": "number"},
    }[hint].copy()
    if meta.get("choices") and hint is str:
        out["enum"] = list(meta["choices"])
    limits = meta.get("range")
    if limits is not None and hint in (int, float):
        out["exclusiveMinimum" if limits.open_low else "minimum"] = limits.low
        out["maximum"] = limits.high
    return out


def _definition(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    if cls.__name__ in defs:
        return defs[cls.__name__]
    hints = typing.get_type_hints(cls)
    node: dict[str, Any] = {"type": "object", "additionalProperties": False}
    defs[cls.__name__] = node
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
        node["description"] = " ".join(cls.__doc__.split())
    properties: dict[str, Any] = {}
    required = []
    for f in dataclasses.fields(cls):
        prop = _field_schema(hints[f.name], f.metadata, defs)
        help_text = f.metadata.get("help")
        limits = f.metadata.get("range")
        if help_text:
            prop["description"] = help_text + (
                f" ({limits.unit})" if limits is not None and limits.unit else ""
            )
        properties[f.name] = prop
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    node["properties"] = properties
    node["required"] = required
    return node


def dataclass_schema(cls: type, title: str) -> dict[str, Any]:
    """A JSON Schema for the JSON form (``dataclasses.asdict``) of dataclass ``cls``."""
    defs: dict[str, Any] = {}
    root = _definition(cls, defs)
    defs.pop(cls.__name__)
    return {"$schema": DIALECT, "title": title, **root, "$defs": dict(sorted(defs.items()))}


def plan_schema() -> dict[str, Any]:
    from areal_hex_plugin.plan import SCHEMA_VERSION, HexPlan

    schema = dataclass_schema(HexPlan, "areal-hex plan (HexPlan), written by `areal-hex plan --json`")
    schema["$id"] = "https://areal-hex/schemas/plan.schema.json"
    schema["properties"]["schema_version"] = {
        "const": SCHEMA_VERSION,
        "description": "the plan format's version",
    }
    schema["required"] = ["schema_version", *schema["required"]]
    return schema
