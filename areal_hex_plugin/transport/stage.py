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

The server loads exactly the bytes the node verified, by path: the stage root lies in this user's private 0700
parent (``scratch.py``), so no other user can rename, replace or add a file there; files are made with
``O_EXCL | O_NOFOLLOW`` and mapped through their own descriptor, a link found in a version's place is removed,
never followed, and right before the load the node checks that the version's directory holds exactly the files it
wrote and verified, the same inodes (:meth:`StagedVersion.changed_files`). Only this user (or root) could change
them after that.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import mmap
import os
import shutil
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.transport.buckets import TensorEntry, named_views
from areal_hex_plugin.transport.protocol import DTYPES

logger = logging.getLogger("HexStage")


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{int(version):d}"


class Mapped(NamedTuple):
    """A bucket file's whole mapping (header and data) and its identity (device, inode)."""

    mapping: torch.Tensor
    identity: tuple[int, int]


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


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
        # Made now: an adoption when the stage has no inode left must not fail.
        self.directory = root / "spare"
        self.directory.mkdir(mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._files: dict[int, list[tuple[Path, Mapped]]] = {}
        self._names = itertools.count()

    def adopt(self, directory: Path, mapped: dict[str, Mapped]) -> None:
        """Take over the files ``mapped`` names in ``directory`` (moved here), freeing the unused last ones; a
        failed move raises after the files moved so far are taken over."""
        files: dict[int, list[tuple[Path, Mapped]]] = {}
        try:
            for name, file in mapped.items():
                path = self.directory / f"{next(self._names)}.bin"
                (directory / name).rename(path)
                files.setdefault(file.mapping.numel(), []).append((path, file))
        finally:
            self._swap(files)

    def release(self) -> None:
        """Free every page not taken (a version received before the last one was adopted leaves them unused)."""
        self._swap({})

    def _swap(self, files: dict[int, list[tuple[Path, Mapped]]]) -> None:
        with self._lock:
            unused, self._files = self._files, files
        for path, _ in (file for same_size in unused.values() for file in same_size):
            path.unlink(missing_ok=True)

    def take(self, size: int) -> tuple[Path, Mapped] | None:
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
        self.directory.mkdir(mode=0o700)
        self._identity = _identity(os.lstat(self.directory))
        # Where the files went once spilled (``directory`` is then a link there), removed with the version.
        self.spilled: Path | None = None
        self.buckets: dict[int, tuple[list[TensorEntry], torch.Tensor]] = {}
        # Each bucket file's name, mapping and inode, handed to the spare pages on retirement.
        self.mapped: dict[str, Mapped] = {}
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
            mapped.mapping[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        else:
            mapped = self._new_file(path, header, total, index)
            self._fresh[index] = (path, len(header))
        data = mapped.mapping[len(header) :]
        self.buckets[index] = (entries, data)
        self.mapped[path.name] = mapped
        self._copies[index] = copy
        return data

    def _new_file(self, path: Path, header: bytes, total: int, index: int) -> Mapped:
        """A new file (never one already there, nor through a link) of ``total`` bytes starting with ``header``,
        mapped through the descriptor that made it."""
        free = shutil.disk_usage(self.directory).free
        if free < total:
            raise self._too_small(free, total, index)
        handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if os.pwrite(handle, header, 0) != len(header):
                raise OSError(errno.ENOSPC, f"{path}: header cut short")
            os.ftruncate(handle, total)
            mapping = mmap.mmap(handle, total)
            identity = _identity(os.fstat(handle))
        finally:
            os.close(handle)
        return Mapped(torch.frombuffer(mapping, dtype=torch.uint8), identity)

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
        handle = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if _identity(os.fstat(handle)) != self.mapped[path.name].identity:
                raise OSError(errno.ESTALE, f"{path} is no longer the file this bucket is mapped from")
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

    def changed_files(self) -> str:
        """What in ``directory`` is not exactly the files this version wrote, the same inodes ('' when nothing):
        a file replaced, added or removed after its bytes were verified, or the directory itself replaced."""
        try:
            if _identity(os.lstat(self.directory)) != self._identity:
                return f"{self.directory} was replaced"
            names = set(os.listdir(self.directory))
            if names != set(self.mapped):
                odd = sorted(names ^ set(self.mapped))[:5]
                return f"{self.directory} does not hold exactly the files written there (differs: {odd})"
            for name, file in self.mapped.items():
                info = os.lstat(self.directory / name)
                if not stat.S_ISREG(info.st_mode) or _identity(info) != file.identity or info.st_nlink != 1:
                    return f"{name} in {self.directory} was replaced after it was verified"
        except OSError as error:
            return f"cannot check {self.directory} ({error})"
        return ""

    def remove(self) -> bool:
        """Remove the version's files (and its spilled copy); a failure (e.g. out of descriptors) is logged as an
        error and False is returned, for the caller to call again later."""
        self.buckets, self.mapped, self._fresh = {}, {}, {}
        try:
            remove_version(self.directory)
            if self.spilled is not None:
                remove_version(self.spilled)
        except OSError as error:
            logger.error("cannot remove staged version %s (%s); will try again", self.directory, error)
            return False
        return True

    def retire(self) -> bool:
        """No longer needed: the files in memory become spare pages (where there are any), the rest goes (False:
        its removal failed, as :meth:`remove`)."""
        if self._spare is not None and self.spilled is None:
            self._give_pages(self.directory)
        return self.remove()

    def _give_pages(self, directory: Path) -> None:
        """Hand the files in ``directory`` to the spare pages; one that cannot move is freed with the rest."""
        try:
            self._spare.adopt(directory, self.mapped)
        except OSError as error:
            logger.error("cannot keep the pages of %s spare (%s); they are freed", directory, error)

    def spill(self, root: Path) -> None:
        """Move this loaded version's files to ``root`` (node-local disk) and leave a link under the old name, so
        whoever reloads ``directory`` (SGLang's roll-back to the path it loaded last) still finds them, out of
        memory; its pages in memory become spare pages.

        The copy and the link are made before anything is renamed: a failure at any step (out of space or inodes
        here or on the disk) raises with the version still in ``directory``, whole, and nothing the spill made
        left behind. The name is absent only between two renames in this node's own directory, while no load
        runs (a commit waits for the keeper that spills)."""
        directory = self.directory
        target, link = root / directory.name, directory.with_name(f"{directory.name}.link")
        moved = directory.with_name(f"{directory.name}.spilled")
        for leftover in (target, link, moved):
            remove_version(leftover)
        try:
            shutil.copytree(directory, target, symlinks=True)
            link.symlink_to(target, target_is_directory=True)
            _swap_names(directory, link, moved)
        except OSError:
            link.unlink(missing_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            raise
        self.spilled = target
        if self._spare is not None:
            self._give_pages(moved)
        self.buckets, self.mapped = {}, {}
        try:
            remove_version(moved)
        except OSError as error:  # the version is spilled all the same; stop() removes the whole stage root
            logger.error(
                "version %s is spilled but its staged copy %s stays (%s)", directory.name, moved, error
            )


def _swap_names(directory: Path, link: Path, moved: Path) -> None:
    """``directory`` becomes ``link`` (its contents going to ``moved``), or stays as it was."""
    directory.rename(moved)
    try:
        link.rename(directory)
    except OSError:
        moved.rename(directory)
        raise


def remove_version(directory: Path) -> None:
    """A version's directory, or a link in its place (never what a link points to: a spilled version removes its
    copy itself); raises the first failure once everything that could go is gone."""
    failures: list[BaseException] = []

    def failed(function, path, info) -> None:
        if not isinstance(info[1], FileNotFoundError):
            failures.append(info[1])

    if directory.is_symlink():
        directory.unlink(missing_ok=True)
    else:
        shutil.rmtree(directory, onerror=failed)
    if failures:
        raise failures[0]
