"""Is ``a.b.c`` a key of a config dataclass, and if not, which key was meant: for overrides and for the keys of
upstream's config (``HexGRPOConfig``), walked through the dataclasses' type hints."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from functools import cache

# How deep the whole-schema search for a meant key goes (upstream's config nests four levels).
MAX_DEPTH = 5


@dataclass(frozen=True)
class KeyCheck:
    """``known``: True (a field), False (no such field; ``meant`` is the closest key, if any) or None (under a
    mapping, a list or a type the walk cannot see into: the schema cannot tell)."""

    known: bool | None
    meant: str | None = None


@cache
def _fields(cls: type) -> dict[str, typing.Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a forward reference the module cannot resolve: the declared types still name fields
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _dataclass(hint: typing.Any) -> type | None:
    """The dataclass ``hint`` is, or is an Optional of."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return _dataclass(inner[0])
    return None


@cache
def _leaves(cls: type, depth: int = MAX_DEPTH) -> tuple[str, ...]:
    """Every dotted key of ``cls`` (nested dataclasses included, up to ``depth`` levels)."""
    out = []
    for name, hint in _fields(cls).items():
        out.append(name)
        inner = _dataclass(hint)
        if inner is not None and depth > 1:
            out.extend(f"{name}.{leaf}" for leaf in _leaves(inner, depth - 1))
    return tuple(out)


def closest(word: str, names: list[str]) -> str | None:
    """The name spelled most like ``word``, or whose start is (``budget`` for ``budget_per_hour``)."""
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    if close:
        return close[0]
    starts: dict[str, str] = {}
    for name in sorted(names, key=len):
        starts.setdefault(name[: len(word)], name)
    close = difflib.get_close_matches(word, list(starts), n=1, cutoff=0.75)
    return starts[close[0]] if close else None


def check_key(root: type, key: str) -> KeyCheck:
    """Whether dotted ``key`` names a field of dataclass ``root``; for one that does not, the key meant: a
    sibling spelled alike, else any key of the schema whose last part is."""
    cls, parts = root, key.split(".")
    for i, part in enumerate(parts):
        fields = _fields(cls)
        if part not in fields:
            prefix = ".".join(parts[:i])
            sibling = closest(part, list(fields))
            if sibling is not None:
                return KeyCheck(False, f"{prefix}.{sibling}" if prefix else sibling)
            leaves = _leaves(root)
            by_leaf = closest(part, [leaf.rsplit(".", 1)[-1] for leaf in leaves])
            meant = next((leaf for leaf in leaves if leaf.rsplit(".", 1)[-1] == by_leaf), None)
            return KeyCheck(False, meant)
        if i == len(parts) - 1:
            return KeyCheck(True)
        inner = _dataclass(fields[part])
        if inner is None:
            return KeyCheck(None)
        cls = inner
    return KeyCheck(None)
