"""``areal-hex estimate RECIPE``: per GPU type, the best single-type rollout replica and training layout."""

from __future__ import annotations

import argparse

from areal_hex_plugin.commands.common import add_recipe_arguments, load_recipe_from_args
from areal_hex_plugin.outfiles import check_writable, console, write_json
from areal_hex_plugin.progress import working

SCHEMA_VERSION = 1  # of the --json document (areal_hex_plugin/schemas/estimate.schema.json)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "estimate", help="per GPU type: rollout and training tokens/s per GPU from the cost model"
    )
    add_recipe_arguments(parser)
    parser.add_argument("--json", metavar="OUT", help="also write the estimates as JSON here; - for stdout")
    parser.set_defaults(run=run)


def _rollout_entry(stages, est) -> dict:
    if est is None:
        return {"feasible": False, "reason": "no GPUs"}
    entry = {"feasible": est.feasible, "reason": est.reason}
    if stages is not None:
        entry["stages"] = [{"pool": s.pool, "tp": s.tp} for s in stages]
    if est.feasible:
        entry.update(
            tp=stages[0].tp,
            pp=len(stages),
            gpus=est.n_gpus,
            tokens_per_s=round(est.tokens_per_s, 1),
            peak_tokens_per_s=round(est.peak_tokens_per_s, 1),
            concurrency=est.concurrency,
            step_time_ms=round(est.step_time_s * 1e3, 2),
            bound=est.bound,
            decode_source=est.decode_source,
            weights_gb_per_gpu=round(est.weights_gb_per_gpu, 2),
            kv_gb_per_gpu=round(est.kv_gb_per_gpu, 2),
            kv_capacity_tokens=est.kv_capacity_tokens,
            layers=list(est.layers),
        )
    return entry


def _train_entry(stages, est) -> dict:
    if est is None:
        return {"feasible": False, "reason": "no GPUs"}
    entry = {"feasible": est.feasible, "reason": est.reason}
    if stages is not None:
        entry["stages"] = [{"pool": s.pool, "dp": s.dp, "tp": s.tp} for s in stages]
    if est.feasible:
        entry.update(
            gpus=est.n_gpus,
            step_time_s=round(est.step_time_s, 2),
            tokens_per_s=round(est.tokens_per_s, 1),
            layers=list(est.layers),
            memory_gb_per_gpu=[round(m, 2) for m in est.memory_gb_per_gpu],
            breakdown_s={k: round(v, 3) for k, v in est.breakdown.items()},
        )
    return entry


def estimate(recipe) -> dict:
    """The ``--json`` document for a loaded recipe."""
    from areal_hex_plugin.costmodel import CostModel
    from areal_hex_plugin.costmodel.single_type import SINGLE_TYPE_MAX_PP, best_rollout, best_train
    from areal_hex_plugin.costmodel.sources import phase_sources

    calibration = recipe.calibration
    cm = CostModel(recipe.cluster, recipe.workload, calibration)
    max_pp = min(recipe.solver.max_pp_stages, SINGLE_TYPE_MAX_PP)
    per_type: dict[str, dict] = {}
    for gpu_type in recipe.cluster.gpu_types:
        # The type's largest pool: the most room for multi-machine layouts.
        pool = max((p for p in recipe.cluster.pools if p.gpu_type == gpu_type), key=lambda p: p.n_gpus)
        r_stages, r_est = best_rollout(cm, pool, max_pp)
        t_stages, t_est = best_train(cm, pool, max_pp)
        rollout_per_gpu = r_est.tokens_per_s / r_est.n_gpus if r_est and r_est.feasible else 0.0
        train_per_gpu = t_est.tokens_per_s / t_est.n_gpus if t_est and t_est.feasible else 0.0
        price = pool.price_per_gpu_hour
        per_type[gpu_type] = {
            "pool": pool.name,
            "price_per_gpu_hour": price,
            "rollout_tokens_per_s_per_gpu": round(rollout_per_gpu, 2),
            "train_tokens_per_s_per_gpu": round(train_per_gpu, 2),
            "rollout_usd_per_mtoken": round(price / 3600 / rollout_per_gpu * 1e6, 4)
            if rollout_per_gpu
            else None,
            "train_usd_per_mtoken": round(price / 3600 / train_per_gpu * 1e6, 4) if train_per_gpu else None,
            "rollout": _rollout_entry(r_stages, r_est),
            "train": _train_entry(t_stages, t_est),
            "sources": phase_sources(
                calibration,
                {"rollout": [gpu_type], "train": [gpu_type]},
                r_est.decode_source if r_est and r_est.feasible else "roofline",
            ),
        }
    wl = recipe.workload
    return {
        "schema_version": SCHEMA_VERSION,
        "recipe": str(recipe.path),
        "model": wl.model.name,
        "workload": {
            "tokens_per_step": round(wl.tokens_per_step),
            "prompt_tokens": wl.prompt_tokens,
            "mean_output_tokens": round(wl.output_lengths.mean, 1),
            "max_new_tokens": wl.rl.max_new_tokens,
            "max_head_offpolicyness": wl.rl.max_head_offpolicyness,
        },
        "calibration": calibration.as_dict(recipe.cluster.gpu_types),
        "per_gpu_type": per_type,
    }


def _usd(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _table(doc: dict, stream) -> str:
    from areal_hex_plugin.tables import render_table

    rows = []
    for gpu_type, e in doc["per_gpu_type"].items():
        r, t = e["rollout"], e["train"]
        r_layout = (
            f"TP{r['tp']} PP{r['pp']}, {r['concurrency']} seqs, {r['bound']} ({r['decode_source']})"
            if r["feasible"]
            else r["reason"]
        )
        t_layout = (
            " | ".join(f"dp{s['dp']} tp{s['tp']}" for s in t["stages"])
            + f" ({t['gpus']} GPU{'s' if t['gpus'] > 1 else ''})"
            if t["feasible"]
            else t["reason"]
        )
        rows.append(
            [
                gpu_type,
                f"{e['rollout_tokens_per_s_per_gpu']:,.0f}",
                r_layout,
                f"{e['train_tokens_per_s_per_gpu']:,.0f}",
                t_layout,
                _usd(e["rollout_usd_per_mtoken"]),
                _usd(e["train_usd_per_mtoken"]),
            ]
        )
    headers = [
        "GPU",
        "rollout tok/s/GPU",
        "replica",
        "train tok/s/GPU",
        "layout",
        "$/Mtok rollout",
        "$/Mtok train",
    ]
    right = ("rollout tok/s/GPU", "train tok/s/GPU", "$/Mtok rollout", "$/Mtok train")
    return render_table(headers, rows, right=right, stream=stream)


def run(args: argparse.Namespace) -> int:
    check_writable(args.json, "--json")
    out = console(args.json)
    recipe = load_recipe_from_args(args)
    with working(f"estimating {args.recipe}"):
        doc = estimate(recipe)
    print(f"{doc['model']}: {doc['workload']['tokens_per_step']:,} tokens per step\n", file=out)
    print(_table(doc, out), file=out)
    if args.json:
        write_json(args.json, doc)
    return 0
