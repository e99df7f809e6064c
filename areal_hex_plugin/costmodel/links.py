"""Bandwidth of the links a model crosses, in bytes/s.

GPU links inside a machine (NVLink, PCIe) are catalog line rates, so the GPU type's ``link_efficiency`` scales
them to what NCCL achieves. Network figures between machines and pools come from the recipe, where the user
states what the network delivers (the paper's 5 and 1.5 GB/s are such figures), so they are used as given.
"""

from __future__ import annotations

from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.costmodel.memory import GB
from areal_hex_plugin.specs.cluster import Cluster, Pool


def gpu_link(pool: Pool, calibration: Calibration) -> float:
    """Achieved GPU-to-GPU bandwidth inside one machine of ``pool``."""
    return pool.intra_machine_gb_per_s * GB * calibration.for_gpu(pool.gpu_type).link_efficiency


def network(cluster: Cluster, a: str, b: str) -> float:
    """Machine-to-machine bandwidth between pools ``a`` and ``b`` (inside the pool when a == b)."""
    return cluster.link_gb_per_s(a, b) * GB


def between_stages(cluster: Cluster, calibration: Calibration, a: Pool, b: Pool, same_machine: bool) -> float:
    """Bandwidth of a pipeline hand-off from a stage on ``a`` to the next on ``b``."""
    if a.name == b.name and same_machine:
        return gpu_link(a, calibration)
    return network(cluster, a.name, b.name)
