"""Gantt-style timelines of a simulation: one figure, one panel per pool, one row per trainer / rollout replica,
over the last few steps (a whole run of 30-200 steps would blur into a barcode; ``simulate --trace`` keeps all of
it), with the step boundaries marked and a legend of the states drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_hex_plugin.outfiles import check_writable, save_png
from areal_hex_plugin.sim.result import Segment, SimResult, row_order

COLORS = {
    "train": "#1f77b4",
    "decode": "#2ca02c",
    "prefill": "#ff7f0e",
    "sync": "#d62728",
    "wait": "#c7c7c7",
    "idle": "#eeeeee",
    "stall": "#9467bd",
}
WINDOW_STEPS = 3  # steps drawn: the last ones, in steady state
MAX_ROWS = 24  # rows drawn per pool; the trace has every replica
ROW_INCHES = 0.35


def _window(result: SimResult, steps: int) -> tuple[float, float, str]:
    shown = result.steps[-steps:]
    first = len(result.steps) - len(shown) + 1
    what = f"steps {first}-{len(result.steps)} of {len(result.steps)}" if len(shown) > 1 else "step 1 of 1"
    return shown[0].start_s, shown[-1].end_s, what


def _shown_rows(rows: dict[str, list[Segment]]) -> list[str]:
    """The trainer first, then replicas, at most ``MAX_ROWS``."""
    return sorted(rows, key=row_order)[:MAX_ROWS]


def _draw_pool(ax: Any, rows: dict[str, list[Segment]], window: tuple[float, float]) -> set[str]:
    """One pool's rows as bars on ``ax``; returns the states drawn."""
    start, end = window
    names = _shown_rows(rows)
    drawn: set[str] = set()
    for y, name in enumerate(names):
        by_state: dict[str, list[tuple[float, float]]] = {}
        for s in rows[name]:
            if s.end_s > start and s.start_s < end:
                by_state.setdefault(s.state, []).append((s.start_s, s.end_s - s.start_s))
        for state, bars in by_state.items():
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=COLORS[state])
        drawn.update(by_state)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)  # the first row on top, no empty band above or below
    ax.set_xlim(start, end)
    return drawn


def _pool_title(pool: str, rows: dict[str, list[Segment]]) -> str:
    if len(rows) <= MAX_ROWS:
        return f"pool {pool}"
    return f"pool {pool} (first {MAX_ROWS} of {len(rows)} rows; simulate --trace has all)"


def pool_order(timeline: dict[str, dict[str, list[Segment]]]) -> list[str]:
    """The trainer's pool on top, then the others by name."""
    return sorted(timeline, key=lambda pool: ("trainer" not in timeline[pool], pool))


def _mark_steps(axes: list[Any], result: SimResult, first: int) -> None:
    """A dashed line at each boundary between the steps drawn, on every panel; each step named above the top one."""
    from matplotlib.transforms import blended_transform_factory

    shown = result.steps[first - 1 :]
    for ax in axes:
        for step in shown[:-1]:
            ax.axvline(step.end_s, color="black", ls="--", lw=0.8)
    top = axes[0]
    above = blended_transform_factory(top.transData, top.transAxes)
    for k, step in enumerate(shown, start=first):
        middle = (step.start_s + step.end_s) / 2
        top.text(middle, 1.02, f"step {k}", transform=above, ha="center", va="bottom", fontsize=8)


def timelines_figure(result: SimResult, title: str = "") -> Any:
    """One matplotlib figure: a panel per pool (rows as tall as its replicas), sharing the time axis over the last
    ``WINDOW_STEPS`` steps, step boundaries dashed, and one legend of the states that occur."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    start, end, what = _window(result, WINDOW_STEPS)
    pools = pool_order(result.timeline)
    heights = [len(_shown_rows(result.timeline[p])) for p in pools]
    fig, axes = plt.subplots(
        len(pools),
        1,
        sharex=True,
        squeeze=False,
        figsize=(12, 2.2 + ROW_INCHES * sum(heights) + 0.4 * len(pools)),
        gridspec_kw={"height_ratios": heights},
    )
    axes = list(axes[:, 0])
    drawn: set[str] = set()
    for ax, pool in zip(axes, pools, strict=True):
        drawn |= _draw_pool(ax, result.timeline[pool], (start, end))
        ax.set_title(_pool_title(pool, result.timeline[pool]), loc="left", fontsize=9)
    _mark_steps(axes, result, len(result.steps) - len(result.steps[-WINDOW_STEPS:]) + 1)
    axes[-1].set_xlabel("simulated time (s)")
    fig.suptitle(f"{title}: {what}" if title else what)
    states = [s for s in COLORS if s in drawn]
    fig.legend(
        handles=[Patch(color=COLORS[s], label=s) for s in states],
        ncol=len(states),
        loc="lower center",
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))  # the legend's strip stays clear of the axes
    return fig


def plot_timelines(result: SimResult, out: str | Path, title: str = "") -> Path:
    """Write :func:`timelines_figure` as one PNG (``-``: stdout); return where it went."""
    check_writable(out, "--plot")
    return save_png(timelines_figure(result, title), out, "--plot", dpi=110)
