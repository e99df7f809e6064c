"""A plan for people: the SkyPilot-style console table, and the Pareto plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import IO

from areal_hex_plugin.hostlist import compress_hosts
from areal_hex_plugin.outfiles import check_writable, save_png
from areal_hex_plugin.plan import HexPlan, Sensitivity
from areal_hex_plugin.planner.caps import RuntimeCaps, unmet
from areal_hex_plugin.planner.inflight import drains
from areal_hex_plugin.planner.recipe_planner import AS_WRITTEN_MODE
from areal_hex_plugin.tables import render_table


def _objective(plan: HexPlan) -> str:
    obj = plan.objective
    if obj.kind == "target":
        return f"min $/h reaching {obj.target_tokens_per_s:,.0f} tokens/s"
    where = f"within ${obj.budget_per_hour:,.2f}/h" if obj.kind == "budget" else "on the whole inventory"
    if obj.pick == "knee":
        return f"the knee of the cost vs tokens/s frontier {where}"
    if obj.pick == "cheapest_within_interval":
        share = max(obj.tie_band or 0.0, obj.throughput_tolerance)
        return (
            f"the cheapest plan within {100 * share:.1f}% (the fit's tie band) of the most tokens/s {where}"
        )
    if obj.throughput_tolerance:
        return f"the cheapest plan within {100 * obj.throughput_tolerance:g}% of the most tokens/s {where}"
    return f"max tokens/s {where}"


def _layout_rows(plan: HexPlan) -> list[list[str]]:
    rows = []
    for k, s in enumerate(plan.train.stages):
        rows.append(
            ["train", s.pool, s.gpu_type, f"stage {k}: dp{s.dp} x tp{s.tp}{' hybrid' if s.hybrid else ''}",
             s.dp * s.tp, f"{s.layers} layers",
             compress_hosts(s.hosts)]
        )  # fmt: skip
    for index, g in enumerate(plan.rollout.replicas):
        hosts = sorted(
            {m.host for m in plan.machines for a in m.gpus if a.role == "rollout" and a.group == index}
        )
        rows.append(
            ["rollout", g.pool, g.gpu_type, f"{g.count} x (tp{g.tp} pp{g.pp})", g.count * g.tp * g.pp,
             f"{100 * g.share:.1f}% samples, {g.tokens_per_s:,.0f} tok/s each", compress_hosts(hosts)]
        )  # fmt: skip
    idle: dict[str, list[str]] = {}
    for m in plan.machines:
        if m.role == "idle":
            idle.setdefault(f"{m.pool}\0{m.gpu_type}", []).append(m.host)
    for key, hosts in idle.items():
        pool, gpu_type = key.split("\0")
        rows.append(["idle", pool, gpu_type, f"{len(hosts)} machine(s)", "", "", compress_hosts(hosts)])
    return rows


def _ratio(chosen: float, other: float) -> str:
    return f"{chosen / other:.2f}x" if other > 0 else "-"


def _with_interval(p) -> str:
    """A predicted or baseline tokens/s with its interval (planner/interval.py), where it has one."""
    if p.tokens_per_s_low is None or p.tokens_per_s_high is None:
        return f"{p.tokens_per_s:,.0f}"
    return f"{p.tokens_per_s:,.0f} ({p.tokens_per_s_low:,.0f}-{p.tokens_per_s_high:,.0f})"


def _comparison(plan: HexPlan, stream: IO[str] | None) -> str:
    """The chosen plan beside each baseline, in tokens/s and in tokens per dollar."""
    p = plan.predicted
    label = "as written" if plan.solver.mode == AS_WRITTEN_MODE else "AReaL-Hex (chosen)"
    rows = [[label, f"{p.cost_per_hour:,.2f}", _with_interval(p), f"{p.tokens_per_dollar:,.0f}",
             "", "", _gpus(plan.train.gpus, plan.rollout.gpus), ""]]  # fmt: skip
    for name, b in plan.baselines.items():
        per_dollar = b.tokens_per_s * 3600 / b.cost_per_hour if b.cost_per_hour else 0.0
        rows.append(
            [name, f"{b.cost_per_hour:,.2f}", _with_interval(b), f"{per_dollar:,.0f}",
             _ratio(p.tokens_per_s, b.tokens_per_s), _ratio(p.tokens_per_dollar, per_dollar), _gpus(b.gpus), b.note]
        )  # fmt: skip
    headers = ["plan", "$/h", "tokens/s", "tokens/$", "chosen is: tok/s", "chosen is: tok/$", "GPUs", "note"]
    return render_table(headers, rows, right=headers[1:6], stream=stream)


def _frontier(plan: HexPlan, stream: IO[str] | None) -> str:
    """The Pareto frontier: each point's cost, throughput, throughput per dollar and GPU mix."""
    p = plan.predicted
    marked = [("chosen", p.cost_per_hour, p.tokens_per_s)] + [
        (_ALTERNATIVES[key], a.cost_per_hour, a.tokens_per_s)
        for key, a in plan.alternatives.items()
        if key in _ALTERNATIVES
    ]
    rows = []
    for pt in plan.pareto:
        notes = [
            label
            for label, cost, rate in marked
            if math.isclose(pt.cost_per_hour, cost, rel_tol=1e-6)
            and math.isclose(pt.tokens_per_s, rate, rel_tol=1e-6)
        ]
        per_dollar = pt.tokens_per_s * 3600 / pt.cost_per_hour if pt.cost_per_hour else 0.0
        rows.append(
            [f"{pt.cost_per_hour:,.2f}", f"{pt.tokens_per_s:,.0f}", f"{per_dollar:,.0f}", _gpus(pt.gpus),
             ", ".join(dict.fromkeys(notes))]
        )  # fmt: skip
    return render_table(
        ["$/h", "tokens/s", "tokens/$", "GPUs", "note"],
        rows,
        right=["$/h", "tokens/s", "tokens/$"],
        stream=stream,
    )


# Alternatives' labels (HexPlan.alternatives keys, planner/recipe_planner.py) in the console view.
_ALTERNATIVES = {"cheapest_within_2pct": "cheapest within 2%", "knee": "knee of the frontier"}
# Run length the cost and hours columns are for, unless --steps says otherwise.
DEFAULT_STEPS = 100


def _alternatives(plan: HexPlan, steps: int, stream: IO[str] | None) -> str:
    """The chosen plan beside the cheapest plan within 2% of its tokens/s and the frontier's knee: $/h, tokens/s,
    $ per 1M tokens, and $ and hours for ``steps`` training steps."""
    p = plan.predicted
    tokens_per_step = p.tokens_per_s * p.step_time_s
    points = [
        ("chosen", p.cost_per_hour, p.tokens_per_s, p.step_time_s, _gpus(plan.train.gpus, plan.rollout.gpus))
    ]
    for key, label in _ALTERNATIVES.items():
        if key in plan.alternatives:
            a = plan.alternatives[key]
            step = tokens_per_step / a.tokens_per_s if a.tokens_per_s else math.inf
            points.append((label, a.cost_per_hour, a.tokens_per_s, step, _gpus(a.gpus)))
    rows = []
    for label, cost, rate, step, gpus in points:
        hours = steps * step / 3600
        per_million = cost / (rate * 3600) * 1e6 if rate else math.inf
        rows.append(
            [label, f"{cost:,.2f}", f"{rate:,.0f}", f"{per_million:,.2f}", f"{hours * cost:,.2f}", f"{hours:,.2f}", gpus]
        )  # fmt: skip
    headers = [
        "plan",
        "$/h",
        "tokens/s",
        "$ per 1M tokens",
        f"$ per {steps} steps",
        f"hours per {steps} steps",
        "GPUs",
    ]
    return render_table(headers, rows, right=headers[1:6], stream=stream)


def _runtime(plan: HexPlan) -> str:
    """The runtime settings the plan chose under the staleness bound, and what they buy."""
    st, window = plan.staleness, plan.solver.window_steps
    every = "after every training step" if window == 1 else f"every {window} training steps"
    sequences = sum(g.concurrency * g.count for g in plan.rollout.replicas)
    drain = (
        "; the pipeline drains to its longest sample before each update (fewer than two batches of room "
        "beyond the window), which the step includes"
        if drains(st.max_head_offpolicyness, window)
        else ""
    )
    return (
        f"Runtime (eta={st.max_head_offpolicyness}): weights go to the rollout servers {every} (delta; each "
        f"update pauses generation and rebuilds the in-flight KV cache), at most {st.max_concurrent_rollouts} "
        f"rollouts in flight ({sequences} sequences decoding, each server at its planned batch){drain}"
    )


# Elasticities listed per number in the console view (the largest in size, at least SHOWN_ABOVE).
SHOWN = 4
SHOWN_ABOVE = 0.01


def _sensitivity(s: Sensitivity) -> list[str]:
    """The largest elasticities of the plan's tokens/s and of its ratio to the best baseline."""
    inputs = [(f"{t} {k}", e) for t, per in s.factors.items() for k, e in per.items()]
    inputs += [(k, e) for k, e in s.workload.items()]
    out = [
        f"What the ranking hangs on (elasticity d ln / d ln at +-{100 * s.step:g}% of one input, plan held; "
        f"--json: every factor; a flip check re-ranked {s.candidates} scored plans at +-{100 * s.flip_change:g}%):"
    ]
    for key, label in (
        ("tokens_per_s", "tokens/s"),
        ("vs_best_baseline", "vs the best homogeneous baseline"),
    ):
        values = [(name, getattr(e, key)) for name, e in inputs if getattr(e, key) is not None]
        largest = sorted((v for v in values if abs(v[1]) >= SHOWN_ABOVE), key=lambda v: -abs(v[1]))[:SHOWN]
        shown = ", ".join(f"{name} {value:+.2f}" for name, value in largest) or "none above 0.01"
        out.append(f"  {label}: {shown}")
    return out


def _step_lines(p) -> list[str]:
    """The predicted step, and with preemptible machines in play the expected rate beside the loss-free one."""
    parts = (
        f"weight sync {p.weight_sync_s:.1f}s + max(rollout {p.rollout_time_s:.1f}s incl. reward "
        f"{p.reward_s:.1f}s, train {p.train_time_s:.1f}s)"
    )
    free = p.loss_free_tokens_per_s
    if p.step_time_s_low is not None:
        high = f"{p.step_time_s_high:.1f}s" if p.step_time_s_high is not None else "unbounded"
        parts += f"; interval {p.step_time_s_low:.1f}s to {high} (planner/interval.py)"
    if not free or math.isclose(free, p.tokens_per_s):
        return [f"Predicted step {p.step_time_s:.1f}s = {parts}"]
    return [
        f"Predicted step {p.step_time_s:.1f}s expected with the losses of preemptible machines; with none lost "
        f"{p.step_time_s * p.tokens_per_s / free:.1f}s = {parts}",
        f"Expected {p.tokens_per_s:,.0f} tokens/s with those losses, {free:,.0f} tokens/s with none lost "
        f"({100 * (p.tokens_per_s / free - 1):+.1f}%)",
    ]


def _solver_line(plan: HexPlan) -> str:
    """How the solver fared, with the gap to a proven bound; or that the plan is the recipe's own allocation."""
    s = plan.solver
    if s.mode == AS_WRITTEN_MODE:
        return (
            "Solver: none (the recipe's actor.backend and rollout.backend scored as written, placed as upstream "
            "places them)"
        )
    if s.status == "optimal":
        gap = "optimal over the search space"
    elif s.gap is None:
        gap = "no bound on the distance to the optimum is known"
    else:
        what = "$/h" if plan.objective.kind == "target" else "tokens/s"
        gap = (
            f"at most {100 * s.gap:.1f}% short of optimal in {what} (proven by a relaxation within the budget: "
            "every GPU at its type's training MFU or best rollout tokens/s per GPU)"
        )
    return f"Solver: {s.mode}, {s.status} after {s.iterations} iterations in {s.solve_time_s:.2f}s, {gap}"


def describe_plan(plan: HexPlan, stream: IO[str] | None = None, steps: int | None = None) -> str:
    """The console view: chosen layout, predicted step, baselines, the alternatives on the frontier (costs for
    ``steps`` training steps), the Pareto frontier when computed, binding constraint, why each pool's role.
    ``stream`` is where it will be printed (a terminal gets rich styling)."""
    p = plan.predicted
    out = [f"AReaL-Hex plan for {plan.recipe} ({plan.model}); objective: {_objective(plan)}"]
    out += [f"Planned for {plan.runtime}", ""] if plan.runtime else [""]
    headers = ["role", "pool", "GPU", "layout", "GPUs", "detail", "hosts"]
    out.append(render_table(headers, _layout_rows(plan), right=["GPUs"], stream=stream))
    out += ["", *_step_lines(p), "", _comparison(plan, stream)]
    if plan.alternatives:
        where = "within the budget" if plan.objective.kind == "budget" else "on the whole inventory"
        out += [
            "",
            f"Beside it, on the cost vs tokens/s frontier of the plans scored {where} (--steps N: another run "
            "length; +hex.objective.pick=knee plans the knee, +hex.objective.pick=fastest spends the budget):",
            _alternatives(plan, steps or DEFAULT_STEPS, stream),
        ]
    if plan.pareto:
        out += [
            "",
            f"Pareto frontier ({len(plan.pareto)} points: no cheaper plan is faster):",
            _frontier(plan, stream),
        ]
    out += ["", f"Binding constraint: {plan.binding}"]
    if plan.pool_roles:
        out.append("Why each pool got its role:")
        out += [f"  {pool}: {why}" for pool, why in plan.pool_roles.items()]
    out.append(_solver_line(plan))
    if plan.solver.enumerated:
        out.append(f"Exhaustive: {plan.solver.enumerated}")
    out.append(_runtime(plan))
    if plan.sensitivity:
        out += _sensitivity(plan.sensitivity)
    out += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(out)


def describe_runtime_gap(
    runnable: HexPlan, paper: HexPlan, caps: RuntimeCaps, stream: IO[str] | None = None
) -> str:
    """The paper's unconstrained plan beside the runnable one (made for ``caps``): its layout, what the runtime
    lacks to start it, and the difference in $/h and tokens/s."""
    a, b = runnable.predicted, paper.predicted
    rows = [
        ["runnable (the driver runs it)", f"{a.cost_per_hour:,.2f}", f"{a.tokens_per_s:,.0f}", f"{a.tokens_per_dollar:,.0f}"],
        ["unconstrained (paper's space)", f"{b.cost_per_hour:,.2f}", f"{b.tokens_per_s:,.0f}", f"{b.tokens_per_dollar:,.0f}"],
        ["runnable - unconstrained", f"{a.cost_per_hour - b.cost_per_hour:+,.2f}", f"{a.tokens_per_s - b.tokens_per_s:+,.0f}",
         f"{a.tokens_per_dollar - b.tokens_per_dollar:+,.0f}"],
    ]  # fmt: skip
    headers = ["role", "pool", "GPU", "layout", "GPUs", "detail", "hosts"]
    out = ["# What-if: the paper's unconstrained space", ""]
    out.append(render_table(headers, _layout_rows(paper), right=["GPUs"], stream=stream))
    out += [
        "",
        render_table(
            ["plan", "$/h", "tokens/s", "tokens/$"],
            rows,
            right=["$/h", "tokens/s", "tokens/$"],
            stream=stream,
        ),
    ]
    change = 100 * (a.tokens_per_s / b.tokens_per_s - 1) if b.tokens_per_s else 0.0
    out.append(f"The runnable plan predicts {change:+.1f}% tokens/s against the unconstrained one.")
    lacking = unmet(paper, caps)
    if lacking:
        out.append(f"{caps.describe()} cannot start the unconstrained plan:")
        out += [f"  {what}: {why}" for what, why in lacking.items()]
    return "\n".join(out)


def _gpus(*parts: dict[str, int]) -> str:
    total: dict[str, int] = {}
    for part in parts:
        for gpu_type, n in part.items():
            total[gpu_type] = total.get(gpu_type, 0) + n
    return " + ".join(f"{n} {t}" for t, n in sorted(total.items()))


STAR_SIZE = 220  # the chosen plan's marker area (pt^2)
BASELINE_SIZE = 90
RING_GAP_PT = 7  # a baseline at a point already marked is this much wider than the widest marker there


def _same_point(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(a, b, strict=True))


def _ring_size(at: tuple[float, float], drawn: list[tuple[tuple[float, float], float]]) -> float:
    """A hollow baseline marker's area at ``at``: wider than every marker already drawn there (the chosen plan's
    star, an equal baseline), so each shows as a ring around the ones under it."""
    under = [math.sqrt(size) for point, size in drawn if _same_point(point, at)]
    return (max(under) + RING_GAP_PT) ** 2 if under else BASELINE_SIZE


def frontier_figure(plan: HexPlan):
    """Cost vs tokens/s: the Pareto frontier with each point's GPU mix, the budget or target line, the chosen plan
    and the baselines (a matplotlib figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import StrMethodFormatter

    p, obj = plan.predicted, plan.objective
    fig, ax = plt.subplots(figsize=(9, 5.5))
    if plan.pareto:
        ax.step(
            [pt.cost_per_hour for pt in plan.pareto],
            [pt.tokens_per_s for pt in plan.pareto],
            where="post",
            marker=".",
            color="0.4",
            label="Pareto frontier (best tokens/s for the $/h)",
        )
        right = 0.6 * max(pt.cost_per_hour for pt in plan.pareto)
        for k, pt in enumerate(plan.pareto):
            left = pt.cost_per_hour > right  # labels on the right half point left, staying inside the axes
            ax.annotate(
                _gpus(pt.gpus),
                (pt.cost_per_hour, pt.tokens_per_s),
                xytext=(-4 if left else 4, -11 if k % 2 else 4),
                textcoords="offset points",
                ha="right" if left else "left",
                fontsize=6.5,
                color="0.3",
            )
    if obj.kind == "budget":
        ax.axvline(
            obj.budget_per_hour, ls="--", color="darkorange", label=f"budget ${obj.budget_per_hour:,.2f}/h"
        )
    if obj.kind == "target":
        ax.axhline(
            obj.target_tokens_per_s,
            ls="--",
            color="darkorange",
            label=f"target {obj.target_tokens_per_s:,.0f} tokens/s",
        )
    chosen = (p.cost_per_hour, p.tokens_per_s)
    ax.scatter(*chosen, marker="*", s=STAR_SIZE, color="crimson", zorder=3,
               label=f"chosen: {_gpus(plan.train.gpus, plan.rollout.gpus)}")  # fmt: skip
    drawn = [(chosen, STAR_SIZE)]
    for i, (name, b) in enumerate(plan.baselines.items()):
        if b.tokens_per_s > 0:
            at = (b.cost_per_hour, b.tokens_per_s)
            size = _ring_size(at, drawn)
            drawn.append((at, size))
            same = " (= chosen)" if _same_point(at, chosen) else ""
            ax.scatter(*at, marker="s", s=size, facecolors="none", edgecolors=f"C{i}", linewidths=1.5,
                       zorder=3, label=f"{name}: {_gpus(b.gpus)}{same}")  # fmt: skip
    ax.set_xlabel("cost (US$ per hour)")
    ax.set_ylabel("predicted throughput (tokens/s)")
    ax.xaxis.set_major_formatter(StrMethodFormatter("${x:,.0f}"))
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.set_title(f"{plan.model}: cost vs throughput, {_objective(plan)}", fontsize=10)
    ax.grid(alpha=0.3)
    legend = ax.legend(fontsize=7.5, loc="lower right")
    for handle, text in zip(legend.legend_handles, legend.get_texts(), strict=True):
        if text.get_text().split(":")[0] in plan.baselines:
            handle.set_sizes([BASELINE_SIZE])  # the rings' own sizes would crowd the legend
    fig.tight_layout()
    return fig


def plot_frontier(plan: HexPlan, path: str | Path) -> Path:
    """Write :func:`frontier_figure` as a PNG (``-``: stdout)."""
    check_writable(path, "--plot")
    return save_png(frontier_figure(plan), path, "--plot")
