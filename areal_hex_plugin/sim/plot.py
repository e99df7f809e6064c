"""Gantt-style timelines of a simulation: one PNG per pool, one row per trainer / replica shown."""

from __future__ import annotations

from pathlib import Path

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.outfiles import check_writable, is_stdout, save_png
from areal_hex_plugin.sim.result import SimResult

COLORS = {
    "train": "#1f77b4",
    "decode": "#2ca02c",
    "prefill": "#ff7f0e",
    "sync": "#d62728",
    "wait": "#c7c7c7",
    "idle": "#eeeeee",
}


def plot_timelines(result: SimResult, out: str | Path, title: str = "") -> list[Path]:
    """Write ``OUT-<pool>.png`` for each pool (``OUT`` is ``out`` without its suffix); return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if is_stdout(out):
        raise HexError(
            "--plot", "draws one PNG per pool, so it cannot be stdout", "give a file name, e.g. t.png"
        )
    check_writable(out, "--plot")
    target = Path(out).expanduser()
    written = []
    for pool, rows in sorted(result.timeline.items()):
        fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * len(rows)))
        names = sorted(rows)
        for y, name in enumerate(names):
            for state in COLORS:
                bars = [(s.start_s, s.end_s - s.start_s) for s in rows[name] if s.state == state]
                if bars:
                    ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=COLORS[state])
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("time (s)")
        ax.set_title(f"{title} pool {pool}".strip(), pad=24)
        ax.legend(
            handles=[Patch(color=c, label=s) for s, c in COLORS.items()],
            ncol=6,
            loc="lower center",
            bbox_to_anchor=(0.5, 1.08),
            fontsize=8,
            frameon=False,
        )
        fig.tight_layout()
        path = target.with_name(f"{target.stem}-{pool}{target.suffix or '.png'}")
        written.append(save_png(fig, path, "--plot", dpi=110))
    return written
