"""Where each predicted phase's numbers come from: the method, and the source of every factor it reads."""

from __future__ import annotations

from collections.abc import Iterable

from areal_hex_plugin.costmodel.calibration import Calibration

# The calibration factors each phase reads.
PHASE_FACTORS = {
    "rollout": ("hbm_fraction", "infer_mfu", "decode_overhead_s", "link_efficiency"),
    "train": ("train_mfu", "hbm_fraction", "link_efficiency"),
    "weight_sync": ("update_gb_per_s", "update_fixed_s", "link_efficiency"),
}
# The catalog figures each phase reads (a calibration may carry refit ones in place of the recipe's).
PHASE_FIGURES = {
    "rollout": ("hbm_tb_per_s", "tflops_bf16", "link_gb_per_s"),
    "train": ("tflops_bf16", "hbm_tb_per_s", "link_gb_per_s"),
    "weight_sync": ("link_gb_per_s",),
}
METHODS = {
    "rollout": "per-iteration decode latency from {decode} (costmodel/decode.py)",
    "train": "FLOPs, link traffic and optimizer bytes (costmodel/train.py)",
    "weight_sync": "bytes over the links (costmodel/weightsync.py)",
}


def kind(source: str) -> str:
    """A factor source in one word: "fitted", "measured" (a profile) or "assumed"."""
    if source.startswith("fit to") or "fit to" in source:
        return "fitted"
    if source.startswith("profile") or source.startswith("recipe"):
        return "measured"
    return "assumed"


def phase_sources(
    calibration: Calibration, gpu_types: dict[str, Iterable[str]], decode: str = "roofline"
) -> dict[str, str]:
    """Per phase (``gpu_types``: phase -> the GPU types it runs on), one line: its method, then each factor it
    reads with how it was obtained (fitted / measured / assumed) and the source, factors of one source together;
    then each catalog figure it reads that the calibration gives in place of the recipe's ``hex.gpu_catalog``."""
    out = {}
    for phase, types in gpu_types.items():
        groups: dict[str, list[str]] = {}
        replaced = []
        for gpu_type in sorted(set(types)):
            for factor in PHASE_FACTORS[phase]:
                source = calibration.source(gpu_type, factor)
                groups.setdefault(f"{kind(source)}: {source}", []).append(f"{gpu_type} {factor}")
            for figure in PHASE_FIGURES[phase]:
                value = calibration.figure(gpu_type, figure)
                if value is not None:
                    replaced.append(
                        f"{gpu_type} {figure} {value:.4g} (in place of hex.gpu_catalog's) from "
                        f"{calibration.source(gpu_type, figure)}"
                    )
        parts = [f"{', '.join(names)} {where}" for where, names in groups.items()] + replaced
        out[phase] = METHODS[phase].format(decode=decode) + "; " + "; ".join(parts)
    return out
