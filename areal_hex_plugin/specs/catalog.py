"""GPU catalog: the one source of truth for per-GPU-type hardware figures.

Figures are dense (no sparsity) BF16 tensor-core TFLOPS, HBM capacity in GB (1e9 bytes), HBM bandwidth in
TB/s and the intra-machine GPU link bandwidth in GB/s *per direction* (NVLink, or PCIe when a card has none).
A recipe can override any figure or add a type under ``hex.gpu_catalog``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from areal_hex_plugin.errors import HexError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    tflops_bf16: float
    hbm_gb: float
    hbm_tb_per_s: float
    link_gb_per_s: float
    aliases: tuple[str, ...] = field(default=(), compare=False)
    # Figure name (one of FIGURES) -> where it comes from; ``areal-hex catalog`` prints them.
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def flops(self) -> float:
        return self.tflops_bf16 * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tb_per_s * 1e12

    def source(self, figure: str) -> str:
        return dict(self.sources).get(figure, "")


FIGURES = ("tflops_bf16", "hbm_gb", "hbm_tb_per_s", "link_gb_per_s")


def _cite(everything: str, **figures: str) -> tuple[tuple[str, str], ...]:
    """Each figure's source: ``everything`` unless a figure names its own."""
    return tuple((f, figures.get(f, everything)) for f in FIGURES)


_PCIE4 = "PCIe Gen4 x16: 32 GB/s per direction (no NVLink)"
_PCIE5 = "PCIe Gen5 x16: 64 GB/s per direction"

# Dense (no sparsity) BF16 tensor TFLOPS; where a datasheet gives only the sparse figure, half of it.
BUILTIN_GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("H100", 989.0, 80.0, 3.35, 450.0, aliases=("H100-SXM", "H100-80GB", "H100 80GB HBM3"),
            sources=_cite("NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
                          link_gb_per_s="NVIDIA H100 datasheet: NVLink4 900 GB/s bidirectional")),
    GpuSpec("H800", 989.0, 80.0, 3.35, 200.0, aliases=("H800-SXM", "H800-80GB"),
            sources=_cite("same die and memory as the H100 SXM5 (NVIDIA H100 datasheet; anchors.md §5)",
                          link_gb_per_s="NVLink capped at 400 GB/s bidirectional (anchors.md §5)")),
    # The H800 figures the AReaL-Hex paper uses: the PCIe-class part.
    GpuSpec("H800-PCIe", 756.0, 80.0, 2.0, 200.0, aliases=("H800 PCIe",),
            sources=_cite("AReaL-Hex paper §4 (arXiv 2511.00796); NVIDIA H100 PCIe datasheet: 756 TFLOPS, 2.0 TB/s",
                          link_gb_per_s="AReaL-Hex paper §4: NVLink 400 GB/s bidirectional")),
    GpuSpec("H20", 148.0, 96.0, 4.0, 450.0, aliases=("H20-96GB",),
            sources=_cite("NVIDIA H20 product brief as quoted by the AReaL-Hex paper §4 and anchors.md §5",
                          link_gb_per_s="NVLink4 900 GB/s bidirectional (anchors.md §5)")),
    GpuSpec("H200", 989.0, 141.0, 4.8, 450.0, aliases=("H200-SXM", "H200-141GB"),
            sources=_cite("NVIDIA H200 Tensor Core GPU datasheet (SXM)",
                          link_gb_per_s="NVIDIA H200 datasheet: NVLink 900 GB/s bidirectional")),
    GpuSpec("H100-PCIe", 756.0, 80.0, 2.0, 64.0, aliases=("H100 PCIe", "H100-PCIE-80GB"),
            sources=_cite("NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe: 1,513 TFLOPS BF16 with sparsity, "
                          "80 GB HBM2e, 2.0 TB/s)",
                          link_gb_per_s=f"NVIDIA H100 datasheet: NVLink bridges join pairs only; {_PCIE5} "
                          "between the rest")),
    GpuSpec("A100-80GB", 312.0, 80.0, 2.039, 300.0, aliases=("A100", "A100-SXM4-80GB", "A100-SXM-80GB"),
            sources=_cite("NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 2,039 GB/s)",
                          link_gb_per_s="NVIDIA A100 datasheet: NVLink3 600 GB/s bidirectional")),
    GpuSpec("A100-40GB", 312.0, 40.0, 1.555, 300.0, aliases=("A100-SXM4-40GB", "A100 40GB", "A100-40G"),
            sources=_cite("NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB: 40 GB HBM2, 1,555 GB/s)",
                          link_gb_per_s="NVIDIA A100 datasheet: NVLink3 600 GB/s bidirectional")),
    GpuSpec("A800", 312.0, 80.0, 2.039, 200.0, aliases=("A800-80GB", "A800-SXM4-80GB"),
            sources=_cite("the A100 80GB die and memory (NVIDIA A100 datasheet)",
                          link_gb_per_s="NVLink capped at 400 GB/s bidirectional")),
    GpuSpec("L40S", 362.0, 48.0, 0.864, 32.0,
            sources=_cite("NVIDIA L40S datasheet (362 TFLOPS BF16 dense, 733 with sparsity; 48 GB GDDR6, 864 GB/s)",
                          link_gb_per_s=_PCIE4)),
    GpuSpec("L40", 181.0, 48.0, 0.864, 32.0,
            sources=_cite("NVIDIA L40 datasheet (181 TFLOPS BF16 with FP32 accumulate dense, 362 with sparsity; "
                          "48 GB GDDR6, 864 GB/s)", link_gb_per_s=_PCIE4)),
    GpuSpec("L20", 119.5, 48.0, 0.864, 32.0,
            sources=_cite("NVIDIA L20 datasheet (119.5 TFLOPS FP16/BF16 dense; 48 GB GDDR6, 864 GB/s)",
                          link_gb_per_s=_PCIE4)),
    GpuSpec("L4", 121.0, 24.0, 0.3, 32.0,
            sources=_cite("NVIDIA L4 datasheet (242 TFLOPS BF16 with sparsity; 24 GB GDDR6, 300 GB/s)",
                          link_gb_per_s=_PCIE4)),
    GpuSpec("A10G", 70.0, 24.0, 0.6, 32.0, aliases=("NVIDIA A10G",),
            sources=_cite("AWS G5 (A10G, 24 GB GDDR6, 600 GB/s: the NVIDIA A10 datasheet's memory); NVIDIA publishes "
                          "no A10G sheet",
                          tflops_bf16="70 TFLOPS FP16/BF16 tensor dense, below the A10's 125 (Baseten, 'NVIDIA A10 vs "
                          "A10G for ML model inference')",
                          link_gb_per_s=_PCIE4)),
    GpuSpec("RTX4090", 165.0, 24.0, 1.008, 32.0, aliases=("RTX-4090", "4090", "GeForce RTX 4090"),
            sources=_cite("NVIDIA Ada Lovelace architecture whitepaper (RTX 4090: 165 TFLOPS BF16 with FP32 "
                          "accumulate; 24 GB GDDR6X, 1,008 GB/s)", link_gb_per_s=_PCIE4)),
    GpuSpec("B200", 2250.0, 180.0, 8.0, 900.0, aliases=("B200-180GB",),
            sources=_cite("NVIDIA DGX/HGX B200 datasheet (2.25 PFLOPS BF16 dense per GPU, 180 GB HBM3e, 8 TB/s)",
                          link_gb_per_s="NVIDIA HGX B200: NVLink5 1.8 TB/s bidirectional")),
)  # fmt: skip


def _key(name: str) -> str:
    """Normalise a GPU name for lookup: 'NVIDIA H800 PCIe' -> 'h800pcie'."""
    name = re.sub(r"^((nvidia|geforce)\s+)+", "", name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]", "", name.lower())


class GpuCatalog:
    """Name -> GpuSpec lookup with aliases, case and punctuation folded."""

    def __init__(self, gpus: Mapping[str, GpuSpec]) -> None:
        self._gpus = dict(gpus)
        self._index: dict[str, str] = {}
        for spec in self._gpus.values():
            for alias in (spec.name, *spec.aliases):
                self._index.setdefault(_key(alias), spec.name)

    @property
    def names(self) -> list[str]:
        return sorted(self._gpus)

    def canonical(self, name: str) -> str | None:
        """The catalog name for ``name`` (an alias, an NVML/Slurm/Ray spelling), or None."""
        found = self._index.get(_key(name))
        if found is None:
            # NVML reports e.g. "NVIDIA A100-SXM4-80GB"; Slurm GRES e.g. "a100_80gb".
            found = self._index.get(_key(name).replace("sxm4", "").replace("sxm5", "").replace("sxm", ""))
        return found

    def get(self, name: str, field_path: str = "gpu_type") -> GpuSpec:
        canonical = self.canonical(name)
        if canonical is None:
            raise HexError(
                field_path,
                f"unknown GPU type {name!r}",
                f"use one of {', '.join(self.names)}, or describe it under hex.gpu_catalog.{name} "
                "(tflops_bf16, hbm_gb, hbm_tb_per_s, link_gb_per_s)",
            )
        return self._gpus[canonical]

    def __contains__(self, name: str) -> bool:
        return self.canonical(name) is not None


def build_catalog(overrides: Mapping[str, Mapping[str, float | None]] | None = None) -> GpuCatalog:
    """The built-in catalog with a recipe's ``hex.gpu_catalog`` overrides and additions applied."""
    gpus = {spec.name: spec for spec in BUILTIN_GPUS}
    base = GpuCatalog(gpus)
    for name, figures in (overrides or {}).items():
        path = f"hex.gpu_catalog.{name}"
        given = {k: v for k, v in figures.items() if v is not None}
        for key, value in given.items():
            if not isinstance(value, int | float) or value <= 0:
                raise HexError(
                    f"{path}.{key}", f"must be a positive number, got {value!r}", "set a value > 0"
                )
        canonical = base.canonical(name)
        if canonical is not None:
            spec = gpus[canonical]
            sources = tuple((f, path if f in given else src) for f, src in _cite("", **dict(spec.sources)))
            gpus[canonical] = replace(spec, **given, sources=sources)
            continue
        missing = [k for k in FIGURES if k not in given]
        if missing:
            raise HexError(
                path,
                f"new GPU type {name!r} lacks {', '.join(missing)}",
                f"give all of {', '.join(FIGURES)} for a type the catalog does not know "
                f"(known: {', '.join(base.names)})",
            )
        gpus[name] = GpuSpec(name, **given, sources=_cite(path))
    return GpuCatalog(gpus)
