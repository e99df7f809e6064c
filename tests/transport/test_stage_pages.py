"""A node's stage dir gives a retired version's pages to the next version's buckets instead of allocating fresh
shared memory (and freeing the old) every version: same mappings, exact files, never more held than before."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from areal_hex_plugin.transport.buckets import TensorEntry
from areal_hex_plugin.transport.stage import SparePages, StagedVersion


def _entries(name: str, rows: int) -> list[TensorEntry]:
    return [TensorEntry(name, "float32", (rows, 64), 0, rows * 64 * 4)]


def _stage(root: Path, spare: SparePages, version: int, rows: list[int]) -> tuple[StagedVersion, list[int]]:
    """A version of one float32 tensor per bucket (filled with the version number); each bucket's data address."""
    stage = StagedVersion(root, version, spare)
    addresses = []
    for index, count in enumerate(rows):
        entries = _entries(f"w{index}", count)
        data = stage.allocate(index, 0, entries, entries[0].nbytes)
        data.view(torch.float32).fill_(version)
        addresses.append(data.data_ptr())
    return stage, addresses


def _bytes_under(root: Path) -> int:
    return sum(
        os.lstat(Path(folder, name)).st_size
        for folder, _, names in os.walk(root)
        for name in names
        if not Path(folder, name).is_symlink()
    )


def _holds(stage: StagedVersion, version: int, rows: list[int]) -> bool:
    files = sorted(stage.directory.glob("*.safetensors"))
    loaded = {name: tensor for path in files for name, tensor in load_file(path).items()}
    return loaded.keys() == {f"w{i}" for i in range(len(rows))} and all(
        torch.equal(loaded[f"w{i}"], torch.full((count, 64), float(version))) for i, count in enumerate(rows)
    )


def test_a_retired_versions_pages_stage_the_next_one(tmp_path):
    spare = SparePages(tmp_path)
    rows = [256, 128, 128]
    first, first_addresses = _stage(tmp_path, spare, 1, rows)
    second, second_addresses = _stage(tmp_path, spare, 2, rows)
    held = _bytes_under(tmp_path)  # two versions
    first.retire()  # version 2 is loaded: version 1's pages are spare, nothing freed, nothing more held
    assert not first.directory.exists() and _bytes_under(tmp_path) == held
    third, third_addresses = _stage(tmp_path, spare, 3, rows)
    assert sorted(third_addresses) == sorted(first_addresses)  # the same mapped memory, no new page
    assert _bytes_under(tmp_path) == held and not any(spare.directory.iterdir())
    assert _holds(second, 2, rows) and _holds(third, 3, rows)
    assert [t for _, t in third] and all(float(t.flatten()[0]) == 3.0 for _, t in third)


def test_buckets_of_other_sizes_get_new_files_and_unused_spare_pages_are_freed(tmp_path):
    spare = SparePages(tmp_path)
    first, _ = _stage(tmp_path, spare, 1, [256, 128])
    first.retire()
    second, _ = _stage(tmp_path, spare, 2, [256, 64])  # the 128-row file stays spare, a 64-row one is new
    assert len(list(spare.directory.iterdir())) == 1 and _holds(second, 2, [256, 64])
    second.retire()  # the unused file from version 1 goes now: one version's pages at most
    assert len(list(spare.directory.iterdir())) == 2


def test_a_spilled_version_leaves_its_pages_spare_and_its_files_on_disk(tmp_path):
    stage_root, disk = tmp_path / "stage", tmp_path / "disk"
    stage_root.mkdir()
    disk.mkdir()
    spare = SparePages(stage_root)
    rows = [128, 128]
    first, addresses = _stage(stage_root, spare, 1, rows)
    first.spill(disk)
    assert first.directory.is_symlink() and _holds(first, 1, rows)  # read through the link, from disk
    second, second_addresses = _stage(stage_root, spare, 2, rows)
    assert (
        sorted(second_addresses) == sorted(addresses) and _holds(first, 1, rows) and _holds(second, 2, rows)
    )
    first.retire()  # spilled: its disk copy goes; its pages were already given on
    assert not (disk / "v1").exists() and _holds(second, 2, rows)


def test_pages_given_up_after_the_next_version_was_staged_are_freed_before_its_load(tmp_path):
    # The keeper retires version 1 only after version 2 has arrived in fresh pages: none of version 1's are taken,
    # and the commit releases them, so version 2 loads with one version held (a commit measured 1.58x without).
    spare = SparePages(tmp_path)
    rows = [256, 128]
    first, _ = _stage(tmp_path, spare, 1, rows)
    second, _ = _stage(tmp_path, spare, 2, rows)
    one_version = _bytes_under(second.directory)
    first.retire()
    assert _bytes_under(tmp_path) == 2 * one_version
    spare.release()
    assert _bytes_under(tmp_path) == one_version and _holds(second, 2, rows)
    third, _ = _stage(tmp_path, spare, 3, rows)  # nothing spare: fresh pages, as before
    assert _bytes_under(tmp_path) == 2 * one_version and _holds(third, 3, rows)
