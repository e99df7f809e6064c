"""Host lists written the way Slurm writes them: ``h100-0 .. h100-56`` is ``h100-[0-56]``."""

from __future__ import annotations

import re
from collections.abc import Iterable

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def _ranges(numbers: list[int], width: int) -> str:
    parts: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        a, b = f"{start:0{width}d}", f"{prev:0{width}d}"
        parts.append(a if start == prev else f"{a}-{b}")
        if n is not None:
            start = prev = n
    return ",".join(parts)


def compress_hosts(hosts: Iterable[str]) -> str:
    """``a-0, a-1, a-2, a-5, b`` -> ``a-[0-2,5],b``: one group per prefix (and zero-padded width), in the order
    the prefixes first appear; hosts without a trailing number stay as they are."""
    groups: dict[tuple[str, int], set[int]] = {}
    order: list[tuple[str, int] | str] = []
    for host in hosts:
        match = _NUMBERED.match(host)
        if not match:
            if host not in order:
                order.append(host)
            continue
        prefix, digits = match.groups()
        key = (prefix, len(digits) if digits.startswith("0") and len(digits) > 1 else 0)
        if key not in groups:
            groups[key] = set()
            order.append(key)
        groups[key].add(int(digits))
    out = []
    for key in order:
        if isinstance(key, str):
            out.append(key)
            continue
        prefix, width = key
        numbers = sorted(groups[key])
        body = _ranges(numbers, width)
        out.append(f"{prefix}{body}" if len(numbers) == 1 else f"{prefix}[{body}]")
    return ",".join(out)
