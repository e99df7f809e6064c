"""Buckets: HF-named full tensors packed into one flat byte buffer, with a checksum, and the version digest."""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# Every tensor starts on this many bytes, so a receiver can view its bytes as any dtype in place.
_ALIGN = 16


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Bucket:
    """One bucket: the manifest, the bytes (uint8, contiguous, CPU) and their CRC-32."""

    index: int
    entries: list[TensorEntry]
    data: torch.Tensor
    crc: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def manifest(self) -> list[list[Any]]:
        return [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries]

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Views into the bucket's bytes, with the sender's names, dtypes and shapes."""
        for entry in self.entries:
            raw = self.data[entry.offset : entry.offset + entry.nbytes]
            yield entry.name, raw.view(getattr(torch, entry.dtype)).view(entry.shape)


def checksum(data: torch.Tensor) -> int:
    return zlib.crc32(data.numpy())


def pack(index: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Bucket:
    """Copy the tensors (any device) into one CPU byte buffer."""
    tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
    entries, offset = [], 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(
            TensorEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes)
        )
        offset += -(-nbytes // _ALIGN) * _ALIGN
    data = torch.zeros(offset, dtype=torch.uint8)
    for entry, (_, tensor) in zip(entries, tensors, strict=True):
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        data[entry.offset : entry.offset + entry.nbytes].copy_(flat)
    return Bucket(index, entries, data, checksum(data))


def entries_from_manifest(manifest: list[list[Any]]) -> list[TensorEntry]:
    return [
        TensorEntry(name, dtype, tuple(shape), offset, nbytes)
        for name, dtype, shape, offset, nbytes in manifest
    ]


def version_digest(version: int, buckets: Iterable[tuple[list[list[Any]], int]]) -> str:
    """SHA-256 over the version label and every bucket's manifest and CRC, in bucket order."""
    digest = hashlib.sha256(str(version).encode())
    for manifest, crc in buckets:
        digest.update(json.dumps(manifest, separators=(",", ":")).encode())
        digest.update(crc.to_bytes(4, "big"))
    return digest.hexdigest()
