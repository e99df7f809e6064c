"""Output shared by the benchmarks: the JSON report on stdout, and in a file when asked."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, path: str | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        Path(path).write_text(text + "\n")
