"""Buckets: HF-named full tensors packed into one flat byte buffer, and their keyed digests.

The buffer is a safetensors data section: tensors back to back with no gaps, ordered by element size (largest
first) so every tensor starts aligned for its dtype. Integrity is keyed: per update the sender draws a nonce,
``content key = HMAC(token, "hex-content" | nonce)``, and every chunk gets keyed BLAKE3 (``BLAKE3(key = content
key, bucket | chunk index | bytes)``, 32 bytes); the bucket digest binds the manifest, sizes and chunk digests, a
part digest binds the part (one sender's share of the version) and its bucket digests, the version digest binds the
version and every part digest. Part p of P senders numbers its buckets p, p + P, p + 2P, ... (:func:`bucket_index`), so an index names its
part and no bucket can move between parts. Without the token nobody can make bytes that pass. Chunks are hashed on a thread
pool (blake3 releases the GIL), so a receiver hashes chunk k while chunk k+1 arrives, and a sender sends a bucket's
bytes while they are hashed: the chunk digests follow the payload (a ``digests`` frame after the bucket's bytes).

Keyed BLAKE3 is the chunk MAC because it is the fastest per core of the MACs that stay collision resistant to a
holder of the key (a relay holds the content key, and the replica's seal covers digests, so GMAC, Poly1305 or xxHash
would let a relay swap bytes under it): 4.8 GB/s per core against HMAC-SHA256's 1.2 on this project's 2.8 GHz Xeon
(benchmarks/digest.py), so 3 cores keep up with 100 Gb/s (12.5 GB/s) and 11 with 400 Gb/s (50 GB/s). The pool has a
thread per core the process may run on (its affinity: a container's or taskset's share), at most
:data:`HASH_THREAD_CAP`.
"""

from __future__ import annotations

import hmac
import json
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch

_POSITION = struct.Struct("!IQ")
CHUNK_MAC = "keyed-blake3"
# 16 threads at the per-core figure above hash ~75 GB/s, half again a 400 Gb/s NIC's line rate; more cores than
# that would only take them from the server sharing the machine.
HASH_THREAD_CAP = 16


def hash_threads() -> int:
    """Hashing threads: one per core this process may run on, at most :data:`HASH_THREAD_CAP`."""
    return min(HASH_THREAD_CAP, len(os.sched_getaffinity(0)))


def _hashers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=hash_threads(), thread_name_prefix="hex-hash")


_HASHERS = _hashers()


def _new_pool_after_fork() -> None:
    global _HASHERS  # a forked child has the pool's object but none of its threads
    _HASHERS = _hashers()


os.register_at_fork(after_in_child=_new_pool_after_fork)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def content_key(token: bytes, update: str) -> bytes:
    return hmac.digest(token, b"hex-content" + bytes.fromhex(update), "sha256")


def chunk_digest(key: bytes, index: int, chunk_index: int, data: torch.Tensor) -> str:
    mac = blake3.blake3(_POSITION.pack(index, chunk_index), key=key)
    mac.update(memoryview(data.numpy()))
    return mac.hexdigest()


def hash_chunk(key: bytes, index: int, chunk_index: int, data: torch.Tensor) -> Future[str]:
    """The chunk's digest, computed on the hashing pool."""
    return _HASHERS.submit(chunk_digest, key, index, chunk_index, data)


@dataclass
class Bucket:
    """One bucket: the manifest, the bytes (uint8, contiguous, CPU) and the digest of each chunk. While
    :func:`pack` fills it, ``filled`` says how many leading bytes are in place (:meth:`wait_filled`) and the digests
    of those chunks are being computed on the hashing pool."""

    index: int
    entries: list[TensorEntry]
    data: torch.Tensor
    chunk: int
    hashes: list[Future[str]] = field(default_factory=list)
    filled: int = 0
    failed: str = ""
    _progress: threading.Condition = field(default_factory=threading.Condition, repr=False)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def chunks(self) -> list[str]:
        """The chunk digests (waits for the ones still being computed)."""
        return [future.result() for future in self.hashes]

    def manifest(self) -> list[list[Any]]:
        return [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries]

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return named_views(self.entries, self.data)

    def digest(self, key: bytes) -> str:
        return bucket_digest(key, self.index, self.manifest(), self.chunk, self.chunks)

    def wait_filled(self, end: int) -> None:
        """Block until the first ``end`` bytes are in place; raises if packing failed."""
        with self._progress:
            self._progress.wait_for(lambda: self.filled >= end or self.failed)
        if self.failed:
            raise RuntimeError(f"bucket {self.index} could not be packed: {self.failed}")

    def _advance(self, end: int, key: bytes) -> None:
        """The first ``end`` bytes are in place: hash the chunks they complete, then let senders see them."""
        last = self.nbytes if end == self.nbytes else end - end % self.chunk
        for start in range(len(self.hashes) * self.chunk, last, self.chunk):
            self.hashes.append(
                hash_chunk(key, self.index, len(self.hashes), self.data[start : start + self.chunk])
            )
        with self._progress:
            self.filled = end
            self._progress.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._progress:
            self.failed = f"{type(error).__name__}: {error}"[:2000]
            self._progress.notify_all()


def named_views(entries: list[TensorEntry], data: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views into a bucket's bytes, with the sender's names, dtypes and shapes."""
    for entry in entries:
        raw = data[entry.offset : entry.offset + entry.nbytes]
        yield entry.name, raw.view(getattr(torch, entry.dtype)).view(entry.shape)


def pack(
    index: int,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    key: bytes,
    chunk: int,
    pin: bool = False,
    ready: Callable[[Bucket], None] | None = None,
) -> Bucket:
    """Copy the tensors (any device) into one CPU buffer (pinned when ``pin``), tensor by tensor. ``ready`` gets
    the bucket before the first byte is copied, so its bytes can go out as they land (:meth:`Bucket.wait_filled`);
    each chunk is hashed on the hashing pool once it is whole, and nothing waits for the digests here."""
    tensors = sorted(
        ((name, tensor.detach()) for name, tensor in named_tensors), key=lambda item: -item[1].element_size()
    )
    entries, offset = [], 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(
            TensorEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes)
        )
        offset += nbytes
    bucket = Bucket(index, entries, torch.empty(offset, dtype=torch.uint8, pin_memory=pin), chunk)
    if ready is not None:
        ready(bucket)
    try:
        for entry, (_, tensor) in zip(entries, tensors, strict=True):
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            target = bucket.data[entry.offset : entry.offset + entry.nbytes]
            if flat.device.type == "cpu":  # one memcpy on this thread: torch's copy_ would wake its OpenMP
                target.numpy()[:] = (
                    flat.numpy()
                )  # pool, whose threads then spin on the cores links and hashes need
            else:
                target.copy_(flat, non_blocking=pin)
            end = entry.offset + entry.nbytes
            if end == offset or end // chunk > entry.offset // chunk:  # a chunk became whole
                if pin:
                    torch.cuda.current_stream().synchronize()
                bucket._advance(end, key)
    except BaseException as error:
        bucket._fail(error)
        raise
    return bucket


def entries_from_manifest(manifest: list[list[Any]]) -> list[TensorEntry]:
    return [
        TensorEntry(name, dtype, tuple(shape), offset, nbytes)
        for name, dtype, shape, offset, nbytes in manifest
    ]


def bucket_digest(key: bytes, index: int, manifest: list[list[Any]], chunk: int, chunks: list[str]) -> str:
    body = json.dumps([index, manifest, chunk, chunks], separators=(",", ":")).encode()
    return hmac.digest(key, b"hex-bucket" + body, "sha256").hex()


def bucket_index(part: int, parts: int, order: int) -> int:
    """The version-wide index of part ``part``'s ``order``-th bucket."""
    return order * parts + part


def part_digest(key: bytes, part: int, bucket_digests: list[str]) -> str:
    body = json.dumps([part, bucket_digests], separators=(",", ":")).encode()
    return hmac.digest(key, b"hex-part" + body, "sha256").hex()


def replica_key(channel_key: bytes, session: str) -> bytes:
    """The key only the trainer and one replica hold for a session: from the key of the control channel between
    them (its handshake's fresh nonces), never seen by a relay, which holds the token and the content key."""
    return hmac.digest(channel_key, b"hex-replica" + session.encode(), "sha256")


def seal(key: bytes, session: str, version: int, digest: str) -> str:
    """The trainer's MAC over a version digest, keyed by :func:`replica_key`: what a replica checks, over the
    digests of exactly the bytes it staged, before it verifies and again right before it commits."""
    body = json.dumps([session, version, digest], separators=(",", ":")).encode()
    return hmac.digest(key, b"hex-seal" + body, "sha256").hex()


def version_digest(key: bytes, version: int, part_digests: list[str]) -> str:
    body = json.dumps([version, part_digests], separators=(",", ":")).encode()
    return hmac.digest(key, b"hex-version" + body, "sha256").hex()
