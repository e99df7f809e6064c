"""Plain data and bad input: the route the integration side fills from the plan, and transport settings."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.transport import buckets
from areal_hex_plugin.transport.buckets import content_key, pack, version_digest
from areal_hex_plugin.transport.protocol import MIN_CHUNK_BYTES
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


def test_bucket_round_trip_and_keyed_digests():
    tensors = [
        ("a", torch.arange(6, dtype=torch.bfloat16).view(2, 3)),
        ("b", torch.ones(4, dtype=torch.int64)),
        ("c", torch.ones(3, dtype=torch.uint8)),
    ]
    key = content_key(b"t" * 32, "ab" * 32)
    bucket = pack(0, tensors, key, chunk=MIN_CHUNK_BYTES)
    got = dict(bucket.named_tensors())
    assert all(torch.equal(got[name], tensor) and got[name].dtype == tensor.dtype for name, tensor in tensors)
    assert [e.name for e in bucket.entries] == ["b", "a", "c"]  # largest elements first: every offset aligned
    assert bucket.nbytes == 32 + 12 + 3  # back to back, a safetensors data section
    digest = version_digest(key, 1, [bucket.digest(key)])
    assert digest != version_digest(key, 2, [bucket.digest(key)])  # the label is part of the digest
    other_key = content_key(b"t" * 32, "cd" * 32)
    assert digest != version_digest(other_key, 1, [bucket.digest(other_key)])  # and the key
    bucket.data[40] ^= 1
    assert pack(0, bucket.named_tensors(), key, chunk=MIN_CHUNK_BYTES).chunks != bucket.chunks


def test_pack_returns_before_its_chunks_are_hashed(monkeypatch):
    """The sender sends a bucket's bytes while they are hashed: packing does not wait for the digests."""
    gate = threading.Event()
    real = buckets.chunk_digest

    def gated(*args):
        gate.wait(10)
        return real(*args)

    monkeypatch.setattr(buckets, "chunk_digest", gated)
    key = content_key(b"t" * 32, "ab" * 32)
    packed = []
    thread = threading.Thread(
        target=lambda: packed.append(
            pack(0, [("w", torch.ones(3 * MIN_CHUNK_BYTES, dtype=torch.uint8))], key, chunk=MIN_CHUNK_BYTES)
        )
    )
    thread.start()
    thread.join(5)
    try:
        assert packed and not any(future.done() for future in packed[0].hashes)
    finally:
        gate.set()
    monkeypatch.setattr(buckets, "chunk_digest", real)
    assert packed[0].chunks == [
        real(key, 0, i, packed[0].data[i * MIN_CHUNK_BYTES : (i + 1) * MIN_CHUNK_BYTES]) for i in range(3)
    ]


def test_pack_hands_the_bucket_over_before_copying_and_publishes_each_whole_chunk():
    key = content_key(b"t" * 32, "ab" * 32)
    tensors = [(f"w{i}", torch.full((MIN_CHUNK_BYTES,), i, dtype=torch.uint8)) for i in range(3)]
    seen = []
    bucket = pack(
        0, tensors, key, chunk=MIN_CHUNK_BYTES, ready=lambda b: seen.append((b.filled, len(b.hashes)))
    )
    assert seen == [(0, 0)] and bucket.filled == bucket.nbytes and len(bucket.hashes) == 3
    assert bucket.chunks == pack(0, tensors, key, chunk=MIN_CHUNK_BYTES).chunks
    broken = []
    with pytest.raises(NotImplementedError):
        pack(1, [("w", torch.empty(8, device="meta"))], key, chunk=MIN_CHUNK_BYTES, ready=broken.append)
    with pytest.raises(RuntimeError, match="bucket 1 could not be packed"):
        broken[0].wait_filled(1)  # a sender waiting for its bytes hears it instead of hanging
