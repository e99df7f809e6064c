"""Human-readable summaries of a recipe's cluster and workload."""

from __future__ import annotations

from typing import IO

from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.recipe import Recipe
from areal_hex_plugin.specs.workload import WorkloadSpec
from areal_hex_plugin.tables import render_table


def describe_cluster(cluster: Cluster, stream: IO[str] | None = None) -> str:
    rows = [
        [
            p.name,
            p.gpu_type,
            f"{p.machines} x {p.gpus_per_machine}",
            p.n_gpus,
            f"{p.price_per_gpu_hour:.2f}",
            f"{p.n_gpus * p.price_per_gpu_hour:.2f}",
            f"{p.gpu.tflops_bf16:g}",
            f"{p.gpu.hbm_gb:g}",
            f"{p.gpu.hbm_tb_per_s:g}",
            f"{p.intra_machine_gb_per_s:g} / {p.inter_machine_gb_per_s:g}",
        ]
        for p in cluster.pools
    ]
    rows.append(["total", "", "", cluster.n_gpus, "", f"{cluster.price_per_hour:.2f}", "", "", "", ""])
    headers = [
        "pool",
        "GPU",
        "machines",
        "GPUs",
        "$/GPU-h",
        "$/h",
        "TFLOPS",
        "HBM GB",
        "HBM TB/s",
        "GB/s in/out machine",
    ]
    right = ("machines", "GPUs", "$/GPU-h", "$/h", "TFLOPS", "HBM GB", "HBM TB/s")
    text = render_table(headers, rows, right=right, stream=stream)
    names = [p.name for p in cluster.pools]
    links = [
        f"{a} <-> {b}: {cluster.link_gb_per_s(a, b):g} GB/s"
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    ]
    return text + ("\ncross-pool links: " + ", ".join(links) if links else "")


def describe_workload(workload: WorkloadSpec, stream: IO[str] | None = None) -> str:
    m, rl, lengths = workload.model, workload.rl, workload.output_lengths
    rows = [
        [
            "model",
            f"{m.name}: {m.params / 1e9:.2f}B params, {m.layers} layers, hidden {m.hidden}, "
            f"{m.heads} heads / {m.kv_heads} KV heads, FFN {m.ffn}",
        ],
        ["batch", f"{rl.batch_size} prompts x {rl.n_samples} samples = {rl.samples_per_step} samples/step"],
        [
            "lengths",
            f"prompt {workload.prompt_tokens}; output {lengths.source}: mean {lengths.mean:.0f}, "
            f"p50 {lengths.quantile(0.5)}, p99 {lengths.quantile(0.99)}, max {lengths.max}",
        ],
        ["tokens/step", f"{workload.tokens_per_step / 1e6:.2f}M"],
        [
            "staleness",
            f"max_head_offpolicyness (eta) = {rl.max_head_offpolicyness}, "
            f"max_concurrent_rollouts = {rl.max_concurrent_rollouts}",
        ],
        [
            "training",
            f"{rl.ppo_n_minibatches} minibatches, {rl.forward_passes} extra forward pass(es) per step",
        ],
    ]
    return render_table(["", ""], rows, show_header=False, stream=stream)


def describe_recipe(recipe: Recipe, stream: IO[str] | None = None) -> str:
    cluster, workload = describe_cluster(recipe.cluster, stream), describe_workload(recipe.workload, stream)
    return f"Cluster\n{cluster}\n\nWorkload\n{workload}"
