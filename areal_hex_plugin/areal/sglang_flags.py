"""Per-server SGLang flags (pure): upstream's one ``server_args``, adjusted for each planned server.

Each server gets its replica group's ``tp_size``/``pp_size`` and ``max_running_requests`` = the planned
concurrency, and flags for its GPU type.

FlashAttention-3 (SGLang's ``fa3`` attention backend) runs only on Hopper and Blackwell; other GPUs get
``flashinfer``. Small-memory cards keep more headroom for activations and CUDA graphs, so
``mem_fraction_static`` is capped by the card's HBM.
"""

from __future__ import annotations

from typing import Any

# GPU types (catalog names) whose architecture runs FA3.
FA3_GPUS = frozenset({"H100", "H100-PCIe", "H800", "H800-PCIe", "H20", "H200", "B200"})
# (min HBM GB, max mem_fraction_static): the first row the card reaches applies.
MEM_FRACTION_CAPS = ((70.0, 0.9), (40.0, 0.85), (0.0, 0.8))


def server_args_for(gpu_type: str, hbm_gb: float | None, server_args: dict[str, Any]) -> dict[str, Any]:
    """``server_args`` adjusted for a server on ``gpu_type`` with ``hbm_gb`` of memory (None: unknown)."""
    args = dict(server_args)
    if gpu_type not in FA3_GPUS and args.get("attention_backend") in ("fa3", None):
        args["attention_backend"] = "flashinfer"
    if hbm_gb is None:
        return args
    cap = next(c for floor, c in MEM_FRACTION_CAPS if hbm_gb >= floor)
    if args.get("mem_fraction_static") is None or args["mem_fraction_static"] > cap:
        args["mem_fraction_static"] = cap
    return args


def server_flags(
    gpu_type: str, hbm_gb: float | None, tp: int, pp: int, concurrency: int, base: dict[str, Any]
) -> dict[str, Any]:
    """The flags one planned rollout server overrides in upstream's ``server_args``: its GPU type's attention
    backend and memory fraction (from ``base``, the recipe's), ``tp_size``, ``pp_size`` (upstream sends it only
    above 1) and ``max_running_requests`` = the planned concurrency."""
    flags = server_args_for(gpu_type, hbm_gb, base)
    flags.update(tp_size=tp, pp_size=pp)
    if concurrency:
        flags["max_running_requests"] = concurrency
    return flags
