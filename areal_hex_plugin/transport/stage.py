"""A node's stage directory: each received bucket lands straight in a safetensors file (memory-mapped), so the
staged version is the checkpoint SGLang loads, with no second copy in memory.

Paths are built from integers only: ``<root>/v<version>/bucket-<index>-<copy>.safetensors``. The directory of the last
committed version stays until the next one is confirmed loaded (SGLang rolls back to the path it loaded last); once
loaded it can be spilled (:func:`spill`) to node-local disk, its path becoming a link there, so a commit holds only
the new version in memory (``/dev/shm``) while a failed load still finds the old one.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.transport.buckets import TensorEntry, named_views
from areal_hex_plugin.transport.protocol import DTYPES


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{int(version):d}"


def _header(entries: list[TensorEntry]) -> bytes:
    header = {
        e.name: {
            "dtype": DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [e.offset, e.offset + e.nbytes],
        }
        for e in entries
    }
    header["__metadata__"] = {"format": "pt"}
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


class StagedVersion:
    """The buckets of one version as they arrive; iterates as (name, tensor) views, ``directory`` for loaders."""

    def __init__(self, root: Path, version: int) -> None:
        self.directory = version_dir(root, version)
        remove_version(self.directory)
        self.directory.mkdir(parents=True)
        self.buckets: dict[int, tuple[list[TensorEntry], torch.Tensor]] = {}
        self._copies: dict[int, int] = {}

    def allocate(self, index: int, copy: int, entries: list[TensorEntry], nbytes: int) -> torch.Tensor:
        """The bucket's bytes, backed by a new file (an earlier copy's file is unlinked, never truncated, so its
        mapping stays valid for whoever still reads it); refuses clearly when the stage directory is too small."""
        header = _header(entries)
        total = len(header) + nbytes
        free = shutil.disk_usage(self.directory).free
        if free < total:
            raise HexError(
                "hex.relay.stage_dir",
                f"{self.directory} has {free / 2**20:.2f} MiB free, bucket {index} needs {total / 2**20:.2f} MiB more "
                "(the whole version is staged there; without hex.relay.rollback_dir the last committed one too)",
                "give the container more shared memory (docker run --shm-size=the model's size, twice that without "
                "hex.relay.rollback_dir) or point hex.relay.stage_dir at a larger node-local directory",
            )
        self.drop(index)
        path = self._path(index, copy)
        with open(path, "wb") as handle:
            handle.write(header)
            handle.truncate(total)
        mapped = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        data = mapped[len(header) :]
        self.buckets[index] = (entries, data)
        self._copies[index] = copy
        return data

    def _path(self, index: int, copy: int) -> Path:
        return self.directory / f"bucket-{int(index):05d}-{int(copy):02d}.safetensors"

    def drop(self, index: int) -> None:
        """Forget a bucket (one that failed its digest): its file goes, so no loader sees it."""
        self.buckets.pop(index, None)
        if index in self._copies:
            self._path(index, self._copies.pop(index)).unlink(missing_ok=True)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index in sorted(self.buckets):
            yield from named_views(*self.buckets[index])

    def release(self) -> None:
        """Unmap the files (the directory stays)."""
        self.buckets = {}

    def remove(self) -> None:
        self.release()
        remove_version(self.directory)


def spill(directory: Path, root: Path) -> None:
    """Move a loaded version's files to ``root`` (node-local disk) and leave a link under the old name, so whoever
    reloads ``directory`` (SGLang's roll-back to the path it loaded last) still finds them, out of memory."""
    target = root / directory.name
    remove_version(target)
    try:
        shutil.copytree(directory, target)
    except OSError:  # e.g. the disk is full: nothing half-copied stays
        shutil.rmtree(target, ignore_errors=True)
        raise
    moved = directory.with_name(f"{directory.name}.spilled")
    directory.rename(moved)
    directory.symlink_to(target, target_is_directory=True)
    shutil.rmtree(moved)


def remove_version(directory: Path) -> None:
    """A version's directory, or the link to its spilled files and those files."""
    if directory.is_symlink():
        target = directory.readlink()
        directory.unlink()
        shutil.rmtree(target, ignore_errors=True)
    else:
        shutil.rmtree(directory, ignore_errors=True)
