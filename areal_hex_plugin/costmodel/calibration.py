"""Per-GPU-type efficiency factors: defaults, a profile or fit JSON, and a recipe's ``hex.calibration``.

Each factor is what the cost model cannot derive from the catalog's figures:

* ``train_mfu``: model FLOPs utilisation of a training step (forward, backward, recompute) at a large micro-batch.
* ``infer_mfu``: fraction of peak FLOPS that decode/prefill GEMMs and attention reach when compute-bound.
* ``hbm_fraction``: fraction of the HBM bandwidth that decode kernels (weight and KV-cache reads) sustain.
* ``link_efficiency``: fraction of the GPU link's (NVLink/PCIe) nominal bandwidth that NCCL collectives inside
  a machine achieve. Network figures between machines come from the recipe and are used as given.
* ``update_gb_per_s``: GB/s at which a GPU of the type gathers (trainer) or loads (engine) a weight version.
* ``update_fixed_s``: seconds every weight update costs whatever its size (pause, rendezvous, resume).
* ``decode_overhead_s``: seconds every decode iteration of the engine costs besides its kernels' bytes and FLOPs
  (scheduling, sampling, the CUDA-graph launch, the hand-off to the tokenizer process).

Every factor is a physical quantity with a physical range beside it (:data:`RANGES`): a fraction of a peak
figure that kernels really reach, or a rate or overhead of the order real systems show. A recipe override outside
its range is refused; a fit does not leave it (``areal-hex calibrate`` keeps the best factors inside and names each
measurement they do not explain).

Later sources override earlier ones factor by factor: built-in defaults, then the profile (written by
``areal-hex profile`` or ``areal-hex calibrate``), then the recipe. Every factor in effect records where it came
from (:meth:`Calibration.source`): the built-in defaults are assumptions, not measurements of any type, and are
meant to be replaced by a fit (``costmodel/fit.py``).

A calibration may also carry catalog figures (:attr:`Calibration.figures`): the online refit's corrections of
the figures a recipe declares in its own ``hex.gpu_catalog`` (a belief, unlike the shipped, sourced specs), kept
in a profile's ``gpu_catalog`` section. They take the place of the catalog's in every model built on the
calibration (:meth:`Calibration.on`), over the recipe's ``hex.gpu_catalog``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs import typed
from areal_hex_plugin.specs.catalog import FIGURES, GpuCatalog
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.config import CalibrationConfig, GpuTypeConfig
from areal_hex_plugin.specs.files import read_format

PROFILE_FORMAT = "areal-hex-profile/1"


@dataclass(frozen=True)
class Efficiency:
    train_mfu: float = 0.40
    infer_mfu: float = 0.60
    hbm_fraction: float = 0.80
    link_efficiency: float = 0.80
    update_gb_per_s: float = 5.0
    update_fixed_s: float = 1.5
    decode_overhead_s: float = 1e-3


FACTORS = tuple(f.name for f in fields(Efficiency))


@dataclass(frozen=True)
class Range:
    """The physical range of a factor, inclusive, and why."""

    low: float
    high: float
    why: str

    def __contains__(self, value: float) -> bool:
        return self.low <= value <= self.high

    def __str__(self) -> str:
        return f"{self.low:g} to {self.high:g}"


RANGES: dict[str, Range] = {
    "train_mfu": Range(
        0.05, 0.7, "dense training of 1-100B models: 5% (tiny micro-batches) to 70% (best kernels)"
    ),
    "infer_mfu": Range(0.05, 0.7, "compute-bound prefill/decode GEMMs and attention reach 5% to 70% of peak"),
    "hbm_fraction": Range(0.4, 0.9, "decode kernels stream weights and KV at 40% to 90% of the HBM figure"),
    "link_efficiency": Range(0.3, 0.95, "NCCL bus bandwidth over NVLink/PCIe: 30% to 95% of nominal"),
    "update_gb_per_s": Range(
        0.5, 400.0, "a weight version gathered or loaded at 0.5 (disk) to 400 GB/s (NVLink)"
    ),
    "update_fixed_s": Range(0.01, 60.0, "pause, rendezvous and resume of a weight update: 10 ms to a minute"),
    "decode_overhead_s": Range(1e-4, 5e-3, "per decode iteration outside the kernels: 0.1 to 5 ms"),
}

# Defaults for every GPU type until a profile or fit replaces them: typical Megatron/FSDP MFU on dense 7-14B
# models (~40%), decode GEMMs at large batch (~60% of peak), HBM streaming kernels (~80%), NCCL bus bandwidth
# (~80%); a weight update at a few GB/s plus ~1.5 s fixed, the order AReaL's own updates take (paper Table 2).
GENERIC = Efficiency()
GENERIC_SOURCE = "assumed default (costmodel/calibration.py GENERIC), not measured for this type"

DEFAULTS: dict[str, Efficiency] = {
    # Cards without NVLink: PCIe P2P through the host bridge reaches ~60% of the Gen4 x16 figure (assumed).
    "RTX4090": Efficiency(link_efficiency=0.60),
    "L40S": Efficiency(link_efficiency=0.60),
    "L20": Efficiency(link_efficiency=0.60),
}


def _check_factor(value: object, path: str, name: str = "train_mfu") -> float:
    r = RANGES[name]
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value not in r
    ):
        raise HexError(
            path,
            f"must lie in its physical range {r} ({r.why}), got {value!r}",
            "give the measured or fitted value",
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
            out[key] = _check_factor(value, f"{path}.{key}", key)
    return out


@dataclass(frozen=True)
class Calibration:
    """Efficiency factors per GPU type (catalog names); unlisted types take :data:`DEFAULTS` or :data:`GENERIC`.

    ``sources`` records, per (GPU type, factor or catalog figure), where an overriding value came from;
    ``figures`` the catalog figures (GPU type, figure, value) that replace the catalog's (see the module doc);
    ``residuals``, per GPU type, the root-mean-square of ln(model / measured) over the measurements its factors
    were fitted to.
    """

    overrides: tuple[tuple[str, Efficiency], ...] = ()
    sources: tuple[tuple[str, str, str], ...] = ()
    figures: tuple[tuple[str, str, float], ...] = ()
    residuals: tuple[tuple[str, float], ...] = ()

    def for_gpu(self, gpu_type: str) -> Efficiency:
        for name, eff in self.overrides:
            if name == gpu_type:
                return eff
        return DEFAULTS.get(gpu_type, GENERIC)

    def source(self, gpu_type: str, factor: str) -> str:
        """Where the factor in effect for ``gpu_type`` came from."""
        for name, key, where in self.sources:
            if (name, key) == (gpu_type, factor):
                return where
        return GENERIC_SOURCE

    def residual(self, gpu_type: str) -> float:
        """The fit's residual spread for ``gpu_type`` (rms log error of the measurements fitted; 0: no fit)."""
        return dict(self.residuals).get(gpu_type, 0.0)

    def assumed(self, gpu_type: str, factor: str) -> bool:
        """Whether the factor in effect for ``gpu_type`` is the built-in assumption, not fitted or given."""
        return self.source(gpu_type, factor) == GENERIC_SOURCE

    def with_residual(self, gpu_type: str, residual: float) -> Calibration:
        """A copy recording ``residual`` as the fit's spread for ``gpu_type``."""
        rest = tuple((n, r) for n, r in self.residuals if n != gpu_type)
        return replace(self, residuals=tuple(sorted((*rest, (gpu_type, residual)))))

    def with_factors(self, gpu_type: str, factors: Mapping[str, float], source: str = "") -> Calibration:
        """A copy with some factors of ``gpu_type`` replaced (from ``source``, when given)."""
        updated = replace(self.for_gpu(gpu_type), **factors)
        rest = tuple((n, e) for n, e in self.overrides if n != gpu_type)
        return replace(
            self,
            overrides=tuple(sorted((*rest, (gpu_type, updated)))),
            sources=self._sourced(gpu_type, factors, source),
        )

    def _sourced(self, gpu_type: str, keys: Iterable[str], source: str) -> tuple[tuple[str, str, str], ...]:
        """``sources`` with ``gpu_type``'s ``keys`` now from ``source`` (unchanged when it is empty)."""
        if not source:
            return self.sources
        keys = set(keys)
        kept = tuple(s for s in self.sources if s[0] != gpu_type or s[1] not in keys)
        return tuple(sorted((*kept, *((gpu_type, k, source) for k in sorted(keys)))))

    def figure(self, gpu_type: str, name: str) -> float | None:
        """The catalog figure ``name`` this calibration gives ``gpu_type``; None: the catalog's."""
        return next((v for t, f, v in self.figures if (t, f) == (gpu_type, name)), None)

    def with_figures(self, gpu_type: str, figures: Mapping[str, float], source: str) -> Calibration:
        """A copy in which ``gpu_type``'s catalog ``figures`` (name -> value) are these, from ``source``."""
        kept = tuple(e for e in self.figures if e[0] != gpu_type or e[1] not in figures)
        added = tuple((gpu_type, f, float(v)) for f, v in figures.items())
        return replace(
            self, figures=tuple(sorted((*kept, *added))), sources=self._sourced(gpu_type, figures, source)
        )

    def on(self, cluster: Cluster) -> Cluster:
        """``cluster`` with this calibration's catalog figures in place of the catalog's (itself when none)."""
        if not self.figures:
            return cluster
        pools = []
        for pool in cluster.pools:
            given = {f: v for t, f, v in self.figures if t == pool.gpu_type}
            if given:
                sources = tuple((f, self.source(pool.gpu_type, f)) for f in given)
                gpu = replace(pool.gpu, **given, sources=(*pool.gpu.sources, *sources))
                pool = replace(pool, gpu=gpu)
            pools.append(pool)
        return replace(cluster, pools=tuple(pools))

    def as_dict(self, gpu_types: list[str]) -> dict[str, dict[str, float]]:
        """The factors in effect for ``gpu_types``, for reports."""
        return {name: {k: getattr(self.for_gpu(name), k) for k in FACTORS} for name in gpu_types}

    def sources_dict(self, gpu_types: list[str]) -> dict[str, dict[str, str]]:
        """Where each factor in effect for ``gpu_types`` came from, for reports."""
        return {name: {k: self.source(name, k) for k in FACTORS} for name in gpu_types}

    def profile(self, gpu_types: list[str]) -> dict:
        """The factors in effect for ``gpu_types`` (4 significant digits) and their sources, as a profile JSON
        (``hex.calibration.profile``, read back by :func:`read_profile`); the catalog figures it carries for them
        in ``gpu_catalog`` (read back by :func:`read_profile_figures`), their sources beside the factors'."""
        factors = {t: {k: float(f"{v:.4g}") for k, v in self.as_dict([t])[t].items()} for t in gpu_types}
        out = {"format": PROFILE_FORMAT, "gpu_types": factors, "sources": self.sources_dict(gpu_types)}
        figures = [(t, f, v) for t, f, v in self.figures if t in gpu_types]
        if figures:
            out["gpu_catalog"] = {}
            for t, f, v in figures:
                out["gpu_catalog"].setdefault(t, {})[f] = float(f"{v:.4g}")
                out["sources"][t][f] = self.source(t, f)
        return out


def _load_profile(path: str | Path, field_path: str) -> dict:
    data = read_format(
        path,
        PROFILE_FORMAT,
        field_path,
        "an areal-hex profile",
        "point at a file written by areal-hex profile",
    )
    types = data.get("gpu_types")
    if not isinstance(types, dict) or not types:
        file = Path(path).expanduser()
        raise HexError(field_path, f"{file} lists no gpu_types", "re-run areal-hex profile --gpu-type TYPE")
    return data


def read_profile(
    path: str | Path, field_path: str = "hex.calibration.profile"
) -> dict[str, dict[str, float]]:
    """The per-GPU-type factors in a profile JSON written by ``areal-hex profile`` or ``areal-hex calibrate``."""
    types = _load_profile(path, field_path)["gpu_types"]
    return {str(name): _factor_overrides(values, f"{field_path}[{name}]") for name, values in types.items()}


def read_profile_sources(path: str | Path, field_path: str = "hex.calibration.profile") -> dict[tuple, str]:
    """(GPU type, factor or catalog figure) -> where the profile says the value came from (its ``sources``
    section, else the file itself)."""
    data = _load_profile(path, field_path)
    listed = data.get("sources") if isinstance(data.get("sources"), dict) else {}
    figures = data.get("gpu_catalog") if isinstance(data.get("gpu_catalog"), dict) else {}
    out = {}
    for name, values in [*data["gpu_types"].items(), *figures.items()]:
        for key in values if isinstance(values, dict) else ():
            given = listed.get(name, {}).get(key) if isinstance(listed.get(name), dict) else None
            out[(str(name), key)] = str(given) if given else f"profile {Path(path).name}"
    return out


def read_profile_figures(
    path: str | Path, field_path: str = "hex.calibration.profile"
) -> dict[str, dict[str, float]]:
    """The catalog figures per GPU type in a profile's ``gpu_catalog`` section (an online refit's; none when the
    profile has no such section), each checked as ``hex.gpu_catalog`` checks it."""
    section = _load_profile(path, field_path).get("gpu_catalog", {})
    where = f"{field_path} ({Path(path).name}) gpu_catalog"
    if not isinstance(section, dict):
        raise HexError(where, "must map GPU types to their figures", f"use the figures {', '.join(FIGURES)}")
    out = {}
    for name, values in section.items():
        checked = vars(typed.build(GpuTypeConfig, values, f"{where}.{name}", strict=True))
        out[str(name)] = {k: v for k, v in checked.items() if v is not None}
    return out


def read_profile_residuals(path: str | Path, field_path: str = "hex.calibration.profile") -> dict[str, float]:
    """GPU type -> the rms of ln(model / measured) over the measurements a profile's fit records: per type where
    ``areal-hex profile`` or a refit wrote it (``fit.TYPE.rms_log_error``), else over the ``points`` of an
    ``areal-hex calibrate`` file, those of each point's ``gpu_type`` (every type of the file where a point names
    none: one joint fit). The measurements the fit names as unexplained are among the points: their misses widen
    the spread instead of changing the runtime. Types without recorded measurements are left out."""
    data = _load_profile(path, field_path)
    out: dict[str, float] = {}
    fits = data.get("fit") if isinstance(data.get("fit"), dict) else {}
    for name, fit in fits.items():
        if isinstance(fit, dict) and isinstance(fit.get("rms_log_error"), int | float):
            out[str(name)] = float(fit["rms_log_error"])
    errors: dict[str, list[float]] = {}
    for p in data.get("points") or []:
        if isinstance(p, dict) and all(
            isinstance(p.get(k), int | float) and p[k] > 0 for k in ("model_value", "measured")
        ):
            for name in [p["gpu_type"]] if isinstance(p.get("gpu_type"), str) else data["gpu_types"]:
                errors.setdefault(str(name), []).append(math.log(p["model_value"] / p["measured"]))
    for name, logs in errors.items():
        out.setdefault(name, math.sqrt(sum(e * e for e in logs) / len(logs)))
    return out


BUILTIN = Path(__file__).resolve().parent / "profiles"


def profile_path(name: str, base_dir: Path | None = None) -> Path:
    """Where a ``hex.calibration.profile`` lives: ``builtin:NAME`` is a fit shipped with the package
    (``costmodel/profiles/NAME.json``, e.g. ``builtin:paper``); a relative path is relative to the recipe."""
    if name.startswith("builtin:"):
        file = BUILTIN / f"{name.removeprefix('builtin:')}.json"
        if not file.is_file():
            shipped = ", ".join(f"builtin:{p.stem}" for p in sorted(BUILTIN.glob("*.json")))
            raise HexError(
                "hex.calibration.profile", f"no built-in profile {name!r}", f"use one of {shipped}"
            )
        return file
    profile = Path(name).expanduser()
    return base_dir / profile if not profile.is_absolute() and base_dir is not None else profile


def with_profile_figures(
    calibration: Calibration,
    profile: str | Path,
    catalog: GpuCatalog,
    field_path: str = "hex.calibration.profile",
) -> Calibration:
    """``calibration`` with the catalog figures of ``profile``'s ``gpu_catalog`` section in place (each with the
    source the profile gives it); GPU names resolve through ``catalog``."""
    said = read_profile_sources(profile, field_path)
    for name, figures in read_profile_figures(profile, field_path).items():
        canonical = catalog.get(name, f"{field_path} gpu_catalog.{name}").name
        for key, value in figures.items():
            calibration = calibration.with_figures(canonical, {key: value}, said[(name, key)])
    return calibration


def build_calibration(
    cfg: CalibrationConfig, catalog: GpuCatalog, base_dir: Path | None = None
) -> Calibration:
    """The calibration a recipe's ``hex.calibration`` asks for; GPU names resolve through ``catalog``."""
    calibration = Calibration()
    layers: list[tuple[str, dict[str, dict[str, float]], dict[tuple, str]]] = []
    if cfg.profile:
        profile = profile_path(cfg.profile, base_dir)
        layers.append(("hex.calibration.profile", read_profile(profile), read_profile_sources(profile)))
        calibration = with_profile_figures(calibration, profile, catalog)
        for name, residual in read_profile_residuals(profile).items():
            canonical = catalog.get(name, f"hex.calibration.profile.{name}").name
            calibration = calibration.with_residual(canonical, residual)
    path = "hex.calibration.gpu_types"
    overrides = {n: _factor_overrides(vars(e), f"{path}.{n}") for n, e in cfg.gpu_types.items()}
    layers.append((path, overrides, {}))
    for where, per_type, sources in layers:
        for name, factors in per_type.items():
            canonical = catalog.get(name, f"{where}.{name}").name
            for key, value in factors.items():
                source = sources.get((name, key), f"recipe {where}.{name}")
                calibration = calibration.with_factors(canonical, {key: value}, source)
    return calibration
