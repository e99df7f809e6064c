"""A node's stage directory: each received bucket lands straight in a safetensors file (memory-mapped), so the
staged version is the checkpoint SGLang loads, with no second copy in memory.

Paths are built from integers only: ``<root>/v<version>/bucket-<index>-<copy>.safetensors``. The directory of the last
committed version stays until the next one is confirmed loaded (SGLang rolls back to the path it loaded last); once
loaded it can be spilled (:meth:`StagedVersion.spill`) to node-local disk, its path becoming a link there, so a commit holds only
the new version in memory (``/dev/shm``) while a failed load still finds the old one.

A version that is no longer needed (the one before the last committed, or the last committed once spilled) does not
give its memory back: its files, still mapped, become :class:`SparePages` that the next version's buckets of the
same sizes are received into. Allocating, zeroing and mapping fresh shared-memory pages, then freeing them, was
about a third of a relay's CPU per version; the stage dir never holds more than before (the spare pages are what the
next version would have allocated anyway).

A bucket's bytes land chunk by chunk (:class:`Landing`): a chunk's view is made when the link asks for it, and the
space of a new file is reserved (``posix_fallocate``) right before its chunk is received into it, so a full stage
dir (e.g. two replicas sharing one ``/dev/shm``) is a clear error on that bucket, never a SIGBUS where the link
writes, and a header alone commits no memory. A version whose removal fails (e.g. out of descriptors) is reported
and removed again later (:meth:`StagedVersion.remove`).
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.transport.buckets import TensorEntry, named_views
from areal_hex_plugin.transport.protocol import DTYPES

logger = logging.getLogger("HexStage")


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


class SparePages:
    """Bucket files of a retired version, each with its mapping, to receive a later version's buckets into (by
    file size). Holds one version's at most: adopting another frees whatever of the last was not taken."""

    def __init__(self, root: Path) -> None:
        self.directory = root / "spare"  # made at the first adoption
        self._lock = threading.Lock()
        self._files: dict[int, list[tuple[Path, torch.Tensor]]] = {}
        self._names = itertools.count()

    def adopt(self, directory: Path, mapped: dict[str, torch.Tensor]) -> None:
        """Take over the files ``mapped`` names in ``directory`` (moved here), freeing the unused last ones."""
        files: dict[int, list[tuple[Path, torch.Tensor]]] = {}
        self.directory.mkdir(exist_ok=True)
        for name, mapping in mapped.items():
            path = self.directory / f"{next(self._names)}.bin"
            (directory / name).rename(path)
            files.setdefault(mapping.numel(), []).append((path, mapping))
        self._swap(files)

    def release(self) -> None:
        """Free every page not taken (a version received before the last one was adopted leaves them unused)."""
        self._swap({})

    def _swap(self, files: dict[int, list[tuple[Path, torch.Tensor]]]) -> None:
        with self._lock:
            unused, self._files = self._files, files
        for path, _ in (file for same_size in unused.values() for file in same_size):
            path.unlink(missing_ok=True)

    def take(self, size: int) -> tuple[Path, torch.Tensor] | None:
        with self._lock:
            same_size = self._files.get(size)
            return same_size.pop() if same_size else None


class Landing:
    """A bucket's bytes as the chunks a link fills in order, each view made (and its space reserved, where the
    file is new) only when the link asks for that chunk."""

    def __init__(self, data: torch.Tensor, step: int, reserve: Callable[[int, int], None] | None) -> None:
        self.data, self.step, self._reserve = data, step, reserve
        self._reserved = 0  # bytes from the start whose space is reserved

    def __len__(self) -> int:
        return -(-self.data.numel() // self.step)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.step
        end = min(start + self.step, self.data.numel())
        if self._reserve is not None and end > self._reserved:
            self._reserve(self._reserved, end)
            self._reserved = end
        return self.data[start:end]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[index] for index in range(len(self)))


class StagedVersion:
    """The buckets of one version as they arrive; iterates as (name, tensor) views, ``directory`` for loaders.
    Buckets go into ``spare`` pages where one of their size is free."""

    def __init__(self, root: Path, version: int, spare: SparePages | None = None) -> None:
        self.directory = version_dir(root, version)
        remove_version(self.directory)
        self.directory.mkdir(parents=True)
        self.buckets: dict[int, tuple[list[TensorEntry], torch.Tensor]] = {}
        # Each bucket file's name and whole mapping (header and data), handed to the spare pages on retirement.
        self.mapped: dict[str, torch.Tensor] = {}
        self._copies: dict[int, int] = {}
        # Each new (not spare) bucket file's path and header size, whose space is reserved as bytes land.
        self._fresh: dict[int, tuple[Path, int]] = {}
        self._spare = spare

    def allocate(self, index: int, copy: int, entries: list[TensorEntry], nbytes: int) -> torch.Tensor:
        """The bucket's bytes, backed by a file of its own (an earlier copy's file is unlinked, never truncated,
        so its mapping stays valid for whoever still reads it): a spare one of its size, else a new one; refuses
        clearly when the stage directory is too small."""
        header = _header(entries)
        total = len(header) + nbytes
        self.drop(index)
        path = self._path(index, copy)
        spare = self._spare.take(total) if self._spare is not None else None
        if spare is not None:
            spare[0].rename(path)
            mapped = spare[1]
            mapped[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        else:
            mapped = self._new_file(path, header, total, index)
            self._fresh[index] = (path, len(header))
        data = mapped[len(header) :]
        self.buckets[index] = (entries, data)
        self.mapped[path.name] = mapped
        self._copies[index] = copy
        return data

    def _new_file(self, path: Path, header: bytes, total: int, index: int) -> torch.Tensor:
        free = shutil.disk_usage(self.directory).free
        if free < total:
            raise self._too_small(free, total, index)
        with open(path, "wb") as handle:
            handle.write(header)
            handle.truncate(total)
        return torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)

    def _too_small(self, free: int, needed: int, index: int) -> HexError:
        return HexError(
            "hex.relay.stage_dir",
            f"{self.directory} has {free / 2**20:.2f} MiB free, bucket {index} needs {needed / 2**20:.2f} MiB more "
            "(the whole version is staged there; without hex.relay.rollback_dir the last committed one too)",
            "give the container more shared memory (docker run --shm-size=the model's size, twice that without "
            "hex.relay.rollback_dir) or point hex.relay.stage_dir at a larger node-local directory",
        )

    def landing(self, index: int, step: int) -> Landing:
        """Where the allocated bucket ``index``'s bytes land, in chunks of ``step`` bytes."""
        fresh = self._fresh.get(index)
        reserve = None if fresh is None else (lambda start, end: self._reserve(index, *fresh, start, end))
        return Landing(self.buckets[index][1], step, reserve)

    def _reserve(self, index: int, path: Path, header: int, start: int, end: int) -> None:
        """Back bytes [start, end) of a new bucket file with real space before anything writes them."""
        handle = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.posix_fallocate(handle, header + start, end - start)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise self._too_small(shutil.disk_usage(self.directory).free, end - start, index) from None
        finally:
            os.close(handle)

    def _path(self, index: int, copy: int) -> Path:
        return self.directory / f"bucket-{int(index):05d}-{int(copy):02d}.safetensors"

    def drop(self, index: int) -> None:
        """Forget a bucket (one that failed its digest): its file goes, so no loader sees it."""
        self.buckets.pop(index, None)
        self._fresh.pop(index, None)
        if index in self._copies:
            path = self._path(index, self._copies.pop(index))
            self.mapped.pop(path.name, None)
            path.unlink(missing_ok=True)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index in sorted(self.buckets):
            yield from named_views(*self.buckets[index])

    def remove(self) -> bool:
        """Remove the version's files; a failure (e.g. out of descriptors) is logged as an error and False is
        returned, for the caller to call again later."""
        self.buckets, self.mapped, self._fresh = {}, {}, {}
        try:
            remove_version(self.directory)
        except OSError as error:
            logger.error("cannot remove staged version %s (%s); will try again", self.directory, error)
            return False
        return True

    def retire(self) -> bool:
        """No longer needed: the files in memory become spare pages (where there are any), the rest goes (False:
        its removal failed, as :meth:`remove`)."""
        if self._spare is not None and not self.directory.is_symlink():
            self._spare.adopt(self.directory, self.mapped)
        return self.remove()

    def spill(self, root: Path) -> None:
        """Move this loaded version's files to ``root`` (node-local disk) and leave a link under the old name, so
        whoever reloads ``directory`` (SGLang's roll-back to the path it loaded last) still finds them, out of
        memory; its pages in memory become spare pages."""
        directory = self.directory
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
        if self._spare is not None:
            self._spare.adopt(moved, self.mapped)
        self.buckets, self.mapped = {}, {}
        shutil.rmtree(moved)


def remove_version(directory: Path) -> None:
    """A version's directory, or the link to its spilled files and those files; raises the first failure once
    everything that could go is gone."""
    failures: list[BaseException] = []

    def failed(function, path, info) -> None:
        if not isinstance(info[1], FileNotFoundError):
            failures.append(info[1])

    if directory.is_symlink():
        target = directory.readlink()
        directory.unlink()
        shutil.rmtree(target, onerror=failed)
    else:
        shutil.rmtree(directory, onerror=failed)
    if failures:
        raise failures[0]
