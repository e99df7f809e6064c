"""The benchmarks' GPU prices and their clusters as recipe overrides (the scheduler tests build theirs here too)."""

from __future__ import annotations

# (GPU type, price per GPU-hour): the paper's relative prices where it has them, the same scale otherwise.
GPUS = {
    "H800-PCIe": 5.28,
    "H20": 1.85,
    "A100-80GB": 2.26,
    "L40S": 1.08,
    "H100": 6.0,
    "H200": 7.5,
    "A800": 2.26,  # MegaScale-Infer's table, as the paper's prices
    "B200": 9.0,  # not in the paper's source: an assumption on the same scale (1.5x H100)
}


def pools_override(pools: list[dict]) -> str:
    """``hex.cluster.pools=[...]`` for pools given as {gpu_type, gpus_per_machine, machines} (and
    inter_machine_gb_per_s, 5 GB/s as the paper's testbed unless given)."""
    items = []
    for i, p in enumerate(pools):
        items.append(
            f"{{name: p{i}, gpu_type: {p['gpu_type']}, gpus_per_machine: {p['gpus_per_machine']}, "
            f"machines: {p['machines']}, price_per_gpu_hour: {GPUS[p['gpu_type']]}, "
            f"inter_machine_gb_per_s: {p.get('inter_machine_gb_per_s', 5.0)}}}"
        )
    return "hex.cluster.pools=[" + ", ".join(items) + "]"
