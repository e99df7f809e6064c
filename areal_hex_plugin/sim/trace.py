"""A simulation as a Chrome / Perfetto trace (the Trace Event Format): one process per pool, one thread per row
(the trainer, every rollout replica), one complete event per segment, and the training steps as a track of
their own. Open it at https://ui.perfetto.dev or chrome://tracing."""

from __future__ import annotations

from typing import Any

from areal_hex_plugin.sim.result import SimResult, row_order

TRACE_VERSION = 1
STEPS_PID = 0  # the process holding the training-step track


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _meta(pid: int, tid: int, kind: str, name: str, index: int) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}},
        {
            "ph": "M",
            "pid": pid,
            "tid": tid,
            "name": f"{kind.split('_')[0]}_sort_index",
            "args": {"sort_index": index},
        },
    ]


def chrome_trace(result: SimResult, title: str = "") -> dict[str, Any]:
    """The trace document for ``result`` (simulated with ``timeline=True``)."""
    events: list[dict[str, Any]] = _meta(STEPS_PID, 0, "process_name", "training steps", 0)
    for k, step in enumerate(result.steps):
        phase = "warm-up" if k < result.warmup_steps else "measured"
        events.append(
            {"ph": "X", "pid": STEPS_PID, "tid": 0, "name": f"step {k + 1}", "cat": phase,
             "ts": _us(step.start_s), "dur": _us(step.step_s),
             "args": {"tokens": step.tokens, "rollout_wait_s": step.rollout_wait_s, "train_s": step.train_s,
                      "sync_s": step.sync_s}}
        )  # fmt: skip
    for pid, (pool, rows) in enumerate(sorted(result.timeline.items()), start=1):
        events += _meta(pid, 0, "process_name", f"pool {pool}", pid)
        names = sorted(rows, key=row_order)
        for tid, name in enumerate(names, start=1):
            events += _meta(pid, tid, "thread_name", name, tid)
            events += [
                {"ph": "X", "pid": pid, "tid": tid, "name": seg.state, "cat": seg.state,
                 "ts": _us(seg.start_s), "dur": _us(seg.end_s - seg.start_s)}
                for seg in rows[name]
                if seg.end_s > seg.start_s
            ]  # fmt: skip
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schema_version": TRACE_VERSION, "title": title, "steps": len(result.steps)},
    }
