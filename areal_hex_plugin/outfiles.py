"""Output files as people use them: ``-`` is stdout, special files are written in place, regular files are
replaced atomically with the mode the umask gives (or the mode the file already had), and missing folders are
created when the output is written (checked before any work: a file in the way or a folder that cannot be made is
refused up front)."""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from areal_hex_plugin.errors import HexError

STDOUT = "-"


def is_stdout(path: str | Path | None) -> bool:
    return path is not None and str(path) == STDOUT


def console(*outputs: str | Path | None) -> IO[str]:
    """Where the human-readable text goes: stderr when an output is ``-`` (stdout then carries the data)."""
    return sys.stderr if any(is_stdout(p) for p in outputs) else sys.stdout


def _umask_mode() -> int:
    mask = os.umask(0o022)  # Python 3.11 has no os.get_umask: read it by setting and restoring it
    os.umask(mask)
    return 0o666 & ~mask


def check_folder(folder: str | Path, what: str) -> Path:
    """Refuse, before any work is done, a folder that is a file or cannot be created (its nearest existing
    ancestor a file or not writable); it is created when written to (:func:`make_folder`)."""
    target = Path(os.path.realpath(Path(folder).expanduser()))
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise HexError(what, f"{existing} is a file, not a folder", "write somewhere else")
    if existing != target and not os.access(existing, os.W_OK | os.X_OK):
        raise HexError(what, f"cannot create {target}: {existing} is not writable", "write somewhere else")
    return target


def make_folder(folder: str | Path, what: str) -> Path:
    """``folder``, created with its parents if missing."""
    target = check_folder(folder, what)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HexError(what, f"cannot create {target}: {exc.strerror}", "write somewhere else") from None
    return target


def check_writable(path: str | Path | None, what: str) -> None:
    """Refuse a destination that is a folder, or whose folder cannot be created, before any work is done."""
    if path is None or is_stdout(path):
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise HexError(what, f"{target} is a folder", "give a file name inside it")
    check_folder(Path(os.path.realpath(target)).parent, what)


def _in_place(target: Path) -> bool:
    """A special file, or a path through /dev or /proc (``/dev/stdout`` redirected to a file is still the
    shell's open file: replacing it would leave the shell writing to a deleted one)."""
    if target.exists() and not target.is_file():
        return True
    hops = [str(target.absolute())] + ([os.readlink(target)] if target.is_symlink() else [])
    return any(hop.startswith(("/dev/", "/proc/")) for hop in hops)


def write_output(path: str | Path, data: str | bytes, what: str = "--json") -> Path:
    """Write ``data`` to ``path`` and return where it went (``Path("-")`` for stdout)."""
    raw = data.encode() if isinstance(data, str) else data
    if is_stdout(path):
        sys.stdout.flush()
        sys.stdout.buffer.write(raw)
        sys.stdout.buffer.flush()
        return Path(STDOUT)
    check_writable(path, what)
    target = Path(path).expanduser()
    try:
        if _in_place(target):
            # /dev/stdout, a fifo, a terminal: write into it (after what this process printed, appending, as a
            # shell's >> would); replacing it would break the pipe, the device or the shell's redirection.
            sys.stdout.flush()
            with open(target, "ab") as handle:
                handle.write(raw)
            return target
        real = Path(os.path.realpath(target))  # a symlink to a file keeps being a symlink
        make_folder(real.parent, what)
        mode = stat.S_IMODE(real.stat().st_mode) if real.exists() else _umask_mode()
        fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(raw)
                os.fchmod(handle.fileno(), mode)
            os.replace(tmp, real)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise HexError(what, f"cannot write {target}: {exc.strerror}", "choose a writable path") from None
    return target


def write_json(path: str | Path, data: Any, what: str = "--json") -> Path:
    return write_output(path, json.dumps(data, indent=2) + "\n", what)


def save_png(fig: Any, path: str | Path, what: str, dpi: int = 120) -> Path:
    """Render a matplotlib figure to PNG and write it like any other output; the figure is closed."""
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    return write_output(path, buffer.getvalue(), what)
