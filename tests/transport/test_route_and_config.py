"""Plain data and bad input: the route the integration side fills from the plan, and transport settings."""

from __future__ import annotations

import re

import pytest
import torch

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.transport.buckets import pack, version_digest
from areal_hex_plugin.transport.route import Endpoint, Route
from areal_hex_plugin.transport.sender import SenderConfig

ROUTE = {
    "pools": [
        {
            "name": "h20",
            "replicas": ["10.0.0.1:29700", "10.0.0.2:29700"],
            "cross_gb_per_s": 1.5,
            "intra_gb_per_s": 5,
        },
        {"name": "l40s", "replicas": ["[fd00::3]:29700"], "cross_gb_per_s": 0.75, "intra_gb_per_s": 5},
    ]
}


def test_route_round_trips_and_bounds_by_the_slowest_pool():
    route = Route.from_dict(ROUTE)
    assert route.replica_count == 3
    assert route.pools[1].replicas == [Endpoint("fd00::3", 29700)]
    assert Route.from_dict(route.to_dict()) == route
    assert route.bound_s(3_000_000_000) == pytest.approx(4.0)  # 3 GB over the 0.75 GB/s link


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"replicas": []}, "pools[0].replicas"),
        ({"replicas": ["10.0.0.1"]}, "pools[0].replicas"),
        ({"replicas": ["10.0.0.1:1", "10.0.0.1:1"]}, "pools[0].replicas"),
        ({"cross_gb_per_s": 0}, "pools[0]"),
    ],
)
def test_bad_routes_name_the_field(change, field):
    data = {"pools": [{**ROUTE["pools"][0], **change}]}
    with pytest.raises(HexError, match=re.escape(f"hex.transport.route.{field}")):
        Route.from_dict(data)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"backend": "mpi"}, "hex.relay.backend"),
        ({"on_failure": "retry"}, "hex.relay.on_failure"),
        ({"timeout_s": 0}, "hex.relay.timeout_s"),
        ({"chunk_bytes": 0}, "hex.relay.chunk_mb"),
        ({"max_resends": -1}, "hex.relay.max_resends"),
    ],
)
def test_bad_sender_settings_name_the_field(settings, field):
    with pytest.raises(HexError, match=field):
        SenderConfig(**settings)


def test_nccl_needs_gpus_here():
    if torch.cuda.is_available():
        pytest.skip("GPUs present")
    with pytest.raises(HexError, match="nccl needs CUDA"):
        SenderConfig(backend="nccl")


def test_bucket_round_trip_and_digest_sensitivity():
    tensors = [
        ("a", torch.arange(6, dtype=torch.bfloat16).view(2, 3)),
        ("b", torch.ones(4, dtype=torch.int64)),
    ]
    bucket = pack(0, tensors)
    assert [(n, t.dtype, t.shape) for n, t in bucket.named_tensors()] == [
        (n, t.dtype, t.shape) for n, t in tensors
    ]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(bucket.named_tensors(), tensors, strict=True))
    digest = version_digest(1, [(bucket.manifest(), bucket.crc)])
    assert digest != version_digest(2, [(bucket.manifest(), bucket.crc)])  # the label is part of the digest
    assert digest != version_digest(1, [(bucket.manifest(), bucket.crc ^ 1)])
