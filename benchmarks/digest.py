"""Keyed chunk digests side by side: GB/s per core of each candidate MAC on the same bytes, and on the hashing pool.

The data is what the transport hashes: a bf16 bucket (``--bucket-mb``, default 256 MiB of random weights) in
chunks (``--chunk-mb``, default 4 MiB), each chunk's MAC over its position (bucket and chunk index) and its bytes,
keyed with a 32-byte content key and 32 bytes out (the ``digests`` frame is unchanged whichever is used). Each
candidate hashes every chunk once per repeat; the candidates take turns within a repeat so a neighbour's burst on
a shared machine hits them alike, and the median of the repeats is kept.

``gb_per_core`` is bytes over the CPU time of the hashing thread (``time.thread_time``): what one core does,
whatever else runs on the machine. ``gb_per_s_one_thread`` is the wall-clock figure on one thread. The pool
(:func:`areal_hex_plugin.transport.buckets.hash_chunk`, the transport's own hashing pool of ``threads`` threads)
then hashes the whole bucket with the transport's chunk digest: ``pool_gb_per_s`` wall-clock, and
``pool_gb_per_core`` over the CPU time the process spent. ``cores_for`` is how many cores at ``gb_per_core`` keep
up with 12.5 GB/s (100 Gb/s) and 50 GB/s (400 Gb/s).

Only MACs whose output is collision resistant even to a holder of the key qualify: a relay holds the content key,
and a replica's end-to-end seal covers digests, so two different chunks with one digest would let a relay swap
bytes under the seal. That rules out GMAC, Poly1305 and non-cryptographic hashes (xxHash), however fast.

    .venv/bin/python benchmarks/digest.py --json digest.json
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import math
import resource
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import torch

from areal_hex_plugin.transport import buckets

TARGETS_GB_PER_S = {"100Gb/s": 12.5, "400Gb/s": 50.0}
_POSITION = struct.Struct("!IQ")


def _hmac_sha256(key: bytes, position: bytes, data: memoryview) -> bytes:
    mac = hmac.new(key, position, "sha256")
    mac.update(data)
    return mac.digest()


def _hmac_sha512_256(key: bytes, position: bytes, data: memoryview) -> bytes:
    mac = hmac.new(key, position, "sha512")
    mac.update(data)
    return mac.digest()[:32]


def _keyed_blake2b(key: bytes, position: bytes, data: memoryview) -> bytes:
    mac = hashlib.blake2b(position, key=key, digest_size=32)
    mac.update(data)
    return mac.digest()


def _keyed_blake2s(key: bytes, position: bytes, data: memoryview) -> bytes:
    mac = hashlib.blake2s(position, key=key)
    mac.update(data)
    return mac.digest()


def _keyed_blake3(key: bytes, position: bytes, data: memoryview) -> bytes:
    mac = blake3.blake3(position, key=key)
    mac.update(data)
    return mac.digest()


CANDIDATES: dict[str, Callable[[bytes, bytes, memoryview], bytes]] = {
    "hmac-sha256": _hmac_sha256,
    "hmac-sha512-256": _hmac_sha512_256,
    "keyed-blake2b-256": _keyed_blake2b,
    "keyed-blake2s-256": _keyed_blake2s,
    "keyed-blake3": _keyed_blake3,
}


def _bucket(nbytes: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(nbytes // 2, dtype=torch.bfloat16).view(torch.uint8)


def _chunks(data: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    return [data[start : start + chunk] for start in range(0, data.numel(), chunk)]


def _one_thread(mac: Callable, key: bytes, chunks: list[torch.Tensor]) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) to MAC every chunk once."""
    cpu, wall = time.thread_time(), time.perf_counter()
    for index, piece in enumerate(chunks):
        mac(key, _POSITION.pack(0, index), memoryview(piece.numpy()))
    return time.thread_time() - cpu, time.perf_counter() - wall


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _on_pool(key: bytes, chunks: list[torch.Tensor]) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) for the transport's hashing pool to digest every chunk."""
    cpu, wall = _process_cpu_s(), time.perf_counter()
    futures = [buckets.hash_chunk(key, 0, index, piece) for index, piece in enumerate(chunks)]
    for future in futures:
        future.result()
    return _process_cpu_s() - cpu, time.perf_counter() - wall


def _cores_for(gb_per_core: float) -> dict[str, int]:
    return {name: math.ceil(target / gb_per_core) for name, target in TARGETS_GB_PER_S.items()}


def measure(bucket_mb: int, chunk_mb: int, repeats: int) -> dict:
    """Every candidate on one thread, then the transport's chunk digest on its pool; medians of ``repeats``."""
    data = _bucket(bucket_mb << 20)
    chunks, key = _chunks(data, chunk_mb << 20), buckets.content_key(b"t" * 32, "ab" * 32)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in CANDIDATES}
    pool: list[tuple[float, float]] = []
    _on_pool(key, chunks)  # start the pool's threads
    for _ in range(repeats):
        for name, mac in CANDIDATES.items():
            times[name].append(_one_thread(mac, key, chunks))
        pool.append(_on_pool(key, chunks))
    gb = data.numel() / 1e9
    algorithms = {}
    for name, runs in times.items():
        per_core = gb / statistics.median(cpu for cpu, _ in runs)
        algorithms[name] = {
            "gb_per_core": round(per_core, 3),
            "gb_per_s_one_thread": round(gb / statistics.median(wall for _, wall in runs), 3),
            "cores_for": _cores_for(per_core),
        }
    pool_per_core = gb / statistics.median(cpu for cpu, _ in pool)
    return {
        "bucket_bytes": data.numel(),
        "chunk_bytes": chunk_mb << 20,
        "repeats": repeats,
        "algorithms": algorithms,
        "transport": {
            "algorithm": buckets.CHUNK_MAC,
            "threads": buckets.hash_threads(),
            "pool_gb_per_s": round(gb / statistics.median(wall for _, wall in pool), 3),
            "pool_gb_per_core": round(pool_per_core, 3),
            "cores_for": _cores_for(pool_per_core),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write the result here (also printed)")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--chunk-mb", type=int, default=4)
    parser.add_argument(
        "--repeats", type=int, default=5, help="passes over the bucket per candidate (median)"
    )
    args = parser.parse_args(argv)
    text = json.dumps(measure(args.bucket_mb, args.chunk_mb, args.repeats), indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
