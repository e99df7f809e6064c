"""``areal-hex catalog``: the GPU types the planner knows, with every figure's source, and the built-in models."""

from __future__ import annotations

import argparse

SCHEMA_VERSION = 1  # of the --json document (areal_hex_plugin/schemas/catalog.schema.json)
HEADINGS = {
    "tflops_bf16": "BF16 TFLOPS",
    "hbm_gb": "memory GB",
    "hbm_tb_per_s": "memory TB/s",
    "link_gb_per_s": "GPU link GB/s",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "catalog", help="list the known GPU types (figures and their sources) and the built-in model shapes"
    )
    parser.add_argument("--json", metavar="OUT", help="also write the catalog as JSON; - for stdout")
    parser.set_defaults(run=run)


def catalog() -> dict:
    """The ``--json`` document: every built-in GPU type and model."""
    from areal_hex_plugin.specs.catalog import BUILTIN_GPUS, FIGURES
    from areal_hex_plugin.specs.models import BUILTIN_MODELS

    gpus = [
        {
            "name": g.name,
            **{f: getattr(g, f) for f in FIGURES},
            "aliases": list(g.aliases),
            "sources": {f: g.source(f) for f in FIGURES},
        }
        for g in sorted(BUILTIN_GPUS, key=lambda g: g.name)
    ]
    models = [
        {
            "name": m.name,
            "params_billion": round(m.params / 1e9, 2),
            "layers": m.layers,
            "hidden": m.hidden,
            "heads": m.heads,
            "kv_heads": m.kv_heads,
            "head_dim": m.dim_per_head,
            "ffn": m.ffn,
            "vocab": m.vocab,
            "tied_embeddings": m.tied_embeddings,
        }
        for m in BUILTIN_MODELS.values()
    ]
    return {"schema_version": SCHEMA_VERSION, "gpus": gpus, "models": models}


def _sources(gpu: dict) -> str:
    """One line per distinct source, naming the figures it gives."""
    by_source: dict[str, list[str]] = {}
    for figure, source in gpu["sources"].items():
        by_source.setdefault(source, []).append(HEADINGS[figure])
    return "\n".join(f"  {gpu['name']}: {', '.join(figs)}: {src}" for src, figs in by_source.items())


def describe(doc: dict, stream) -> str:
    from areal_hex_plugin.tables import render_table

    gpu_rows = [
        [g["name"], f"{g['tflops_bf16']:g}", f"{g['hbm_gb']:g}", f"{g['hbm_tb_per_s']:g}", f"{g['link_gb_per_s']:g}",
         ", ".join(g["aliases"])]
        for g in doc["gpus"]
    ]  # fmt: skip
    headers = ["GPU", *HEADINGS.values(), "also known as"]
    model_rows = [
        [m["name"], f"{m['params_billion']:g}B", m["layers"], m["hidden"], f"{m['heads']} / {m['kv_heads']}",
         m["head_dim"], m["ffn"], m["vocab"]]
        for m in doc["models"]
    ]  # fmt: skip
    model_headers = ["model", "params", "layers", "hidden", "heads / KV", "head dim", "FFN", "vocab"]
    return "\n".join(
        [
            "GPU types (dense BF16 tensor TFLOPS; memory in GB of 1e9 bytes; GPU link per direction):",
            render_table(headers, gpu_rows, right=list(HEADINGS.values()), stream=stream),
            "",
            "Sources:",
            *(_sources(g) for g in doc["gpus"]),
            "",
            "A recipe overrides a figure or adds a type under hex.gpu_catalog.<NAME>.",
            "",
            "Built-in models (actor.path may also be any local Hugging Face model directory):",
            render_table(model_headers, model_rows, right=model_headers[1:], stream=stream),
        ]
    )


def run(args: argparse.Namespace) -> int:
    from areal_hex_plugin.outfiles import check_writable, console, write_json

    check_writable(args.json, "--json")
    out = console(args.json)
    doc = catalog()
    print(describe(doc, out), file=out)
    if args.json:
        write_json(args.json, doc)
    return 0
