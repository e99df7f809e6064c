"""Console tables with rich: bold headers and rules on a terminal, plain aligned text in a pipe or a file."""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from typing import IO, Any

# Plain text: a header, a dashed rule, aligned columns two spaces apart (what tabulate's "simple" prints).
_PLAIN_BOX = "    \n    \n -  \n    \n    \n    \n    \n    \n"


def is_terminal(stream: IO[str] | None = None) -> bool:
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", None)) and stream.isatty()


def render_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    right: Sequence[str] = (),
    stream: IO[str] | None = None,
    show_header: bool = True,
) -> str:
    """``rows`` under ``headers`` (columns named in ``right`` aligned right), styled for ``stream``."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    terminal = is_terminal(stream)
    table = Table(
        box=box.SIMPLE_HEAD if terminal else box.Box(_PLAIN_BOX, ascii=True),
        show_header=show_header,
        show_edge=False,
        pad_edge=False,
        header_style="bold" if terminal else "",
        collapse_padding=True,
    )
    for name in headers:
        table.add_column(name, justify="right" if name in right else "left", no_wrap=True, overflow="ignore")
    for row in rows:
        table.add_row(*("" if cell is None else str(cell) for cell in row))
    buffer = io.StringIO()
    console = Console(
        file=buffer, width=10_000, force_terminal=terminal, color_system="standard" if terminal else None
    )
    console.print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip("\n").splitlines())
