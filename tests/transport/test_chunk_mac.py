"""The chunk MAC: keyed BLAKE3 (picked by GB/s per core, benchmarks/digest.py), hashed on every allowed core."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import blake3
import torch

from areal_hex_plugin.transport.buckets import bucket_digest, chunk_digest, content_key, hash_chunk, pack
from areal_hex_plugin.transport.protocol import MIN_CHUNK_BYTES

KEY = content_key(b"t" * 32, "ab" * 32)


def _weights(nbytes: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(nbytes // 2, dtype=torch.bfloat16)


def test_the_chunk_digest_is_keyed_blake3_over_position_and_bytes():
    data = _weights(3 * MIN_CHUNK_BYTES).view(torch.uint8)
    position = (7).to_bytes(4, "big") + (2).to_bytes(8, "big")
    expected = blake3.blake3(position + data.numpy().tobytes(), key=KEY).hexdigest()
    assert chunk_digest(KEY, 7, 2, data) == expected
    assert len(expected) == 64  # the digests frame carries the same 32 bytes as before


def test_a_flipped_byte_a_wrong_key_or_a_moved_chunk_changes_the_digest():
    data = _weights(MIN_CHUNK_BYTES).view(torch.uint8).clone()
    digest = chunk_digest(KEY, 0, 0, data)
    assert chunk_digest(content_key(b"t" * 32, "cd" * 32), 0, 0, data) != digest
    assert chunk_digest(content_key(b"u" * 32, "ab" * 32), 0, 0, data) != digest
    assert chunk_digest(KEY, 1, 0, data) != digest and chunk_digest(KEY, 0, 1, data) != digest
    data[MIN_CHUNK_BYTES // 2] ^= 0x01
    assert chunk_digest(KEY, 0, 0, data) != digest


def test_sender_and_receiver_agree_on_every_chunk_and_the_bucket():
    """The sender hashes chunks of the bucket it packs; a receiver hashes the same bytes as they land in its own
    buffer, chunk by chunk on the pool: both get the same chunk digests and so the same bucket digest."""
    chunk = 2 * MIN_CHUNK_BYTES
    tensors = [("w", _weights(5 * chunk)), ("b", _weights(chunk + 6))]  # the last chunk is short
    sent = pack(3, tensors, KEY, chunk=chunk)
    staged = torch.empty(sent.nbytes, dtype=torch.uint8)
    landed = []
    for index, start in enumerate(range(0, sent.nbytes, chunk)):
        staged[start : start + chunk] = sent.data[start : start + chunk]
        landed.append(hash_chunk(KEY, 3, index, staged[start : start + chunk]))
    received = [future.result() for future in landed]
    assert received == sent.chunks and len(received) == 7
    assert bucket_digest(KEY, 3, sent.manifest(), chunk, received) == sent.digest(KEY)


def test_the_hashing_pool_runs_one_thread_per_core_the_process_may_use():
    """Under an affinity of one core (a container's or taskset's share of the machine) the pool hashes one chunk at
    a time; with every core of this machine, as many at once as there are cores (up to the pool's cap)."""
    probe = textwrap.dedent(
        """
        import os, sys, threading
        os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
        import torch
        from areal_hex_plugin.transport import buckets

        running, peak, lock, gate = 0, 0, threading.Lock(), threading.Event()
        entered = threading.Condition()

        def gated(*args):
            global running, peak
            with entered:
                running += 1
                peak = max(peak, running)
                entered.notify_all()
            gate.wait(30)
            with entered:
                running -= 1

        buckets.chunk_digest = gated
        cores = len(os.sched_getaffinity(0))
        futures = [buckets.hash_chunk(b"k" * 32, 0, i, torch.zeros(1, dtype=torch.uint8)) for i in range(cores + 2)]
        with entered:
            entered.wait_for(lambda: peak >= cores, timeout=30)
            entered.wait_for(lambda: peak > cores, timeout=0.5)  # must time out: no thread beyond the cores
        gate.set()
        for future in futures:
            future.result()
        print(peak)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    every = sorted(os.sched_getaffinity(0))
    for cpus in ([every[0]], every):
        run = subprocess.run(
            [sys.executable, "-c", probe, ",".join(map(str, cpus))],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert int(run.stdout) == min(len(cpus), 16), (cpus, run.stdout)
