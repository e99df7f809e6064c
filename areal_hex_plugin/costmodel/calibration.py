"""Per-GPU-type efficiency factors: documented defaults, a profile JSON, and a recipe's ``hex.calibration``.

Each factor is the achievable fraction of a catalog figure:

* ``train_mfu``: model FLOPs utilisation of a training step (forward, backward, recompute) at a large micro-batch.
* ``infer_mfu``: fraction of peak FLOPS that decode/prefill GEMMs and attention reach when compute-bound.
* ``hbm_fraction``: fraction of the HBM bandwidth that decode kernels (weight and KV-cache reads) sustain.
* ``link_efficiency``: fraction of the GPU link's (NVLink/PCIe) nominal bandwidth that NCCL collectives inside
  a machine achieve. Network figures between machines come from the recipe and are used as given.

Later sources override earlier ones factor by factor: built-in defaults, then the profile, then the recipe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.catalog import GpuCatalog
from areal_hex_plugin.specs.config import CalibrationConfig
from areal_hex_plugin.specs.files import read_json

if TYPE_CHECKING:
    from areal_hex_plugin.specs.recipe import Recipe

PROFILE_FORMAT = "areal-hex-profile/1"


@dataclass(frozen=True)
class Efficiency:
    train_mfu: float = 0.40
    infer_mfu: float = 0.60
    hbm_fraction: float = 0.80
    link_efficiency: float = 0.80


FACTORS = tuple(f.name for f in fields(Efficiency))

# Defaults for GPU types not listed below: typical Megatron/FSDP MFU on dense 7-14B models (~40%), decode GEMMs
# at large batch (~60% of peak), HBM streaming kernels (~80%), NCCL bus bandwidth (~80%).
GENERIC = Efficiency()

DEFAULTS: dict[str, Efficiency] = {
    # H20: a Hopper die cut to 148 TFLOPS that keeps the 4 TB/s HBM3. The cap, not the SMs, limits its GEMMs, so
    # the decode GEMMs of a CUDA-graph batch (up to 256 sequences, compute-bound on it above ~40) and prefill run at
    # ~90% of that figure. With few SMs per TB/s, the
    # latency-bound decode kernels (paged KV reads, skinny GEMMs at small batch) pull ~65% of the HBM figure.
    # Training MFU is the one factor set from a measurement: the paper's Observation 2 (5 H20 do not reach one
    # H800 in training, paper.md §1.3) puts its achieved training FLOPS at ~0.6x the H800's share; FSDP's
    # bandwidth- and latency-bound work (gathers, recompute, optimizer, launches) does not shrink with the cut
    # compute.
    "H20": Efficiency(train_mfu=0.26, infer_mfu=0.90, hbm_fraction=0.65, link_efficiency=0.80),
    # H800-PCIe (the paper's 756 TFLOPS / 2 TB/s part): a 350 W card whose clocks drop under sustained tensor
    # load; skinny decode GEMMs hold ~40% of the datasheet peak, the large GEMMs of training ~45%. Its HBM2e
    # streams at ~90% of the figure (many SMs per TB/s).
    "H800-PCIe": Efficiency(train_mfu=0.45, infer_mfu=0.40, hbm_fraction=0.90, link_efficiency=0.80),
    # Consumer/PCIe cards: no NVLink, PCIe P2P through the host bridge reaches ~60% of the Gen4 x16 figure.
    "RTX4090": Efficiency(train_mfu=0.35, infer_mfu=0.60, hbm_fraction=0.80, link_efficiency=0.60),
    "L40S": Efficiency(train_mfu=0.35, infer_mfu=0.55, hbm_fraction=0.80, link_efficiency=0.60),
    "L20": Efficiency(train_mfu=0.35, infer_mfu=0.60, hbm_fraction=0.80, link_efficiency=0.60),
}


def _check_factor(value: object, path: str) -> float:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0 < value <= 1
    ):
        raise HexError(
            path, f"must be a fraction in (0, 1], got {value!r}", "give the achieved share of the peak figure"
        )
    return float(value)


def _factor_overrides(values: Mapping[str, object], path: str) -> dict[str, float]:
    if not isinstance(values, Mapping):
        raise HexError(path, "must be a mapping of factor: value", f"use the factors {', '.join(FACTORS)}")
    out: dict[str, float] = {}
    for key, value in values.items():
        if key not in FACTORS:
            raise HexError(f"{path}.{key}", "unknown calibration factor", f"use one of {', '.join(FACTORS)}")
        if value is not None:
            out[key] = _check_factor(value, f"{path}.{key}")
    return out


@dataclass(frozen=True)
class Calibration:
    """Efficiency factors per GPU type (catalog names); unlisted types take :data:`DEFAULTS` or :data:`GENERIC`."""

    overrides: tuple[tuple[str, Efficiency], ...] = ()

    def for_gpu(self, gpu_type: str) -> Efficiency:
        for name, eff in self.overrides:
            if name == gpu_type:
                return eff
        return DEFAULTS.get(gpu_type, GENERIC)

    def with_factors(self, gpu_type: str, factors: Mapping[str, float]) -> Calibration:
        """A copy with some factors of ``gpu_type`` replaced."""
        updated = replace(self.for_gpu(gpu_type), **factors)
        rest = tuple((n, e) for n, e in self.overrides if n != gpu_type)
        return Calibration(tuple(sorted((*rest, (gpu_type, updated)))))

    def as_dict(self, gpu_types: list[str]) -> dict[str, dict[str, float]]:
        """The factors in effect for ``gpu_types``, for reports."""
        return {name: {k: getattr(self.for_gpu(name), k) for k in FACTORS} for name in gpu_types}


def read_profile(
    path: str | Path, field_path: str = "hex.calibration.profile"
) -> dict[str, dict[str, float]]:
    """The per-GPU-type factors in a profile JSON written by ``areal-hex profile``."""
    file = Path(path).expanduser()
    data = read_json(file, field_path, "point at a file written by areal-hex profile")
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise HexError(
            field_path, f"{file} is not an areal-hex profile", f"expected format {PROFILE_FORMAT!r}"
        )
    types = data.get("gpu_types")
    if not isinstance(types, dict) or not types:
        raise HexError(field_path, f"{file} lists no gpu_types", "re-run areal-hex profile --gpu-type TYPE")
    return {str(name): _factor_overrides(values, f"{field_path}[{name}]") for name, values in types.items()}


def build_calibration(
    cfg: CalibrationConfig, catalog: GpuCatalog, base_dir: Path | None = None
) -> Calibration:
    """The calibration a recipe's ``hex.calibration`` asks for; GPU names resolve through ``catalog``."""
    calibration = Calibration()
    layers: list[tuple[str, dict[str, dict[str, float]]]] = []
    if cfg.profile:
        profile = Path(cfg.profile).expanduser()
        if not profile.is_absolute() and base_dir is not None:
            profile = base_dir / profile
        layers.append(("hex.calibration.profile", read_profile(profile)))
    path = "hex.calibration.gpu_types"
    layers.append((path, {n: _factor_overrides(vars(e), f"{path}.{n}") for n, e in cfg.gpu_types.items()}))
    for where, per_type in layers:
        for name, factors in per_type.items():
            canonical = catalog.get(name, f"{where}.{name}").name
            calibration = calibration.with_factors(canonical, factors)
    return calibration


def recipe_calibration(recipe: Recipe) -> Calibration:
    """The calibration a loaded :class:`~areal_hex_plugin.specs.recipe.Recipe` asks for."""
    return build_calibration(recipe.hex.calibration, recipe.catalog, recipe.path.parent)
