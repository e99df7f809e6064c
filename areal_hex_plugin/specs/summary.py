"""Human-readable summaries of a recipe's cluster and workload."""

from __future__ import annotations

from tabulate import tabulate

from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.recipe import Recipe
from areal_hex_plugin.specs.workload import WorkloadSpec


def describe_cluster(cluster: Cluster) -> str:
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
    text = tabulate(rows, headers=headers, tablefmt="simple")
    names = [p.name for p in cluster.pools]
    links = [
        f"{a} <-> {b}: {cluster.link_gb_per_s(a, b):g} GB/s"
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    ]
    return text + ("\ncross-pool links: " + ", ".join(links) if links else "")


def describe_workload(workload: WorkloadSpec) -> str:
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
    return tabulate(rows, tablefmt="plain")


def describe_recipe(recipe: Recipe) -> str:
    return f"Cluster\n{describe_cluster(recipe.cluster)}\n\nWorkload\n{describe_workload(recipe.workload)}"
