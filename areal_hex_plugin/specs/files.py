"""Reading the JSON files a user hands in (plans, profiles, measurements) with one clear error for each way a
file can be unusable: missing, unreadable, too large, not JSON, or nested deeper than any of our formats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_hex_plugin.errors import HexError

# Deeper than any plan, profile or recipe (a plan is 5 levels deep); deeper input would exhaust the
# recursion of the readers behind it.
MAX_DEPTH = 32
MAX_BYTES = 256 << 20


def check_depth(data: Any, field: str, fix: str) -> None:
    """Refuse containers nested more than :data:`MAX_DEPTH` levels deep (without recursing)."""
    level = [data]
    for _ in range(MAX_DEPTH + 1):
        level = [
            child
            for node in level
            if isinstance(node, dict | list)
            for child in (node.values() if isinstance(node, dict) else node)
        ]
        if not level:
            return
    raise HexError(field, f"is nested more than {MAX_DEPTH} levels deep", fix)


def read_json(path: str | Path, field: str, fix: str) -> Any:
    """The JSON document at ``path``; every problem is a :class:`HexError` naming ``field`` with ``fix``."""
    file = Path(path).expanduser()
    try:
        if file.stat().st_size > MAX_BYTES:
            raise HexError(field, f"{file} is larger than {MAX_BYTES >> 20} MB", fix)
        text = file.read_text()
    except OSError as exc:
        raise HexError(field, f"cannot read {file}: {exc.strerror}", fix) from None
    except UnicodeDecodeError:
        raise HexError(field, f"{file} is not UTF-8 text", fix) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HexError(field, f"{file} is not JSON ({exc.msg} at line {exc.lineno})", fix) from None
    except (ValueError, RecursionError) as exc:  # a number of thousands of digits; nesting past the stack
        problem = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(":")[0]
        raise HexError(field, f"{file} is not usable JSON: {problem}", fix) from None
    check_depth(data, field, fix)
    return data


def read_format(path: str | Path, expected: str, field: str, what: str, fix: str) -> dict[str, Any]:
    """The JSON object at ``path`` stating ``"format": expected`` (:func:`read_json`'s checks first); anything else
    is one :class:`HexError` naming ``field``: the file is not ``what``."""
    data = read_json(path, field, fix)
    if not isinstance(data, dict) or data.get("format") != expected:
        file = Path(path).expanduser()
        subject = "" if field == str(file) else f"{file} "  # a field that is the file's name says it already
        raise HexError(field, f"{subject}is not {what} (format {expected!r})", fix)
    return data
