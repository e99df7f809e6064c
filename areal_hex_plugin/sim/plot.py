"""Gantt-style timelines of a simulation: one PNG per pool, one row per trainer / rollout replica, over the
last few steps (a whole run of 30-200 steps would blur into a barcode; ``simulate --trace`` keeps all of it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.outfiles import check_writable, is_stdout, save_png
from areal_hex_plugin.sim.result import Segment, SimResult, row_order

COLORS = {
    "train": "#1f77b4",
    "decode": "#2ca02c",
    "prefill": "#ff7f0e",
    "sync": "#d62728",
    "wait": "#c7c7c7",
    "idle": "#eeeeee",
}
WINDOW_STEPS = 3  # steps drawn: the last ones, in steady state
MAX_ROWS = 24  # rows drawn per pool; the trace has every replica


def _window(result: SimResult, steps: int) -> tuple[float, float, str]:
    shown = result.steps[-steps:]
    first = len(result.steps) - len(shown) + 1
    what = f"steps {first}-{len(result.steps)} of {len(result.steps)}" if len(shown) > 1 else "step 1 of 1"
    return shown[0].start_s, shown[-1].end_s, what


def timeline_figure(rows: dict[str, list[Segment]], title: str, window: tuple[float, float]) -> Any:
    """One pool's figure: the trainer first, then replicas, at most ``MAX_ROWS``; title above, legend below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = sorted(rows, key=row_order)
    if len(names) > MAX_ROWS:
        title += f"\n(first {MAX_ROWS} of {len(names)} rows; simulate --trace has all)"
        names = names[:MAX_ROWS]
    fig, ax = plt.subplots(figsize=(12, 1.8 + 0.35 * len(names)))
    start, end = window
    for y, name in enumerate(names):
        for state, color in COLORS.items():
            bars = [
                (s.start_s, s.end_s - s.start_s)
                for s in rows[name]
                if s.state == state and s.end_s > start and s.start_s < end
            ]
            if bars:
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=color)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(start, end)
    ax.set_xlabel("simulated time (s)")
    ax.set_title(title)
    fig.legend(
        handles=[Patch(color=c, label=s) for s, c in COLORS.items()],
        ncol=len(COLORS),
        loc="lower center",
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))  # the legend's strip along the bottom stays clear of the axes
    return fig


def plot_timelines(result: SimResult, out: str | Path, title: str = "") -> list[Path]:
    """Write ``OUT-<pool>.png`` for each pool (``OUT`` is ``out`` without its suffix); return the paths."""
    if is_stdout(out):
        raise HexError(
            "--plot", "draws one PNG per pool, so it cannot be stdout", "give a file name, e.g. t.png"
        )
    check_writable(out, "--plot")
    target = Path(out).expanduser()
    start, end, what = _window(result, WINDOW_STEPS)
    written = []
    for pool, rows in sorted(result.timeline.items()):
        fig = timeline_figure(rows, f"{title} pool {pool}, {what}".strip(), (start, end))
        path = target.with_name(f"{target.stem}-{pool}{target.suffix or '.png'}")
        written.append(save_png(fig, path, "--plot", dpi=110))
    return written
