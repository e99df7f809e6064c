"""Check that the upstreamable patches in this folder apply cleanly, in order, to the installed areal wheel.

Usage: python patches/check_patches.py [--keep DIR]
Copies the installed ``areal`` package to a scratch folder, applies every ``NNNN-*.patch`` with ``git apply``
(check first, then apply, so later patches see earlier ones) and byte-compiles the result. Exit 0 when all apply.
The plugin never needs these patches: they are the upstreaming proposal (see README.md here).
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PATCHES = sorted(Path(__file__).resolve().parent.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def installed_areal() -> Path:
    spec = importlib.util.find_spec("areal")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("areal is not installed in this interpreter")
    return Path(next(iter(spec.submodule_search_locations)))


def apply_all(root: Path) -> list[tuple[str, bool, str]]:
    """Copy the wheel's ``areal`` under ``root`` and apply every patch; (name, ok, git's message) each."""
    shutil.copytree(installed_areal(), root / "areal", ignore=shutil.ignore_patterns("__pycache__"))
    results = []
    for patch in PATCHES:
        check = subprocess.run(
            ["git", "apply", "--check", str(patch)], cwd=root, capture_output=True, text=True
        )
        if check.returncode == 0:
            subprocess.run(["git", "apply", str(patch)], cwd=root, check=True)
        results.append((patch.name, check.returncode == 0, check.stderr.strip()))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", metavar="DIR", help="apply into DIR (must not exist) and keep it")
    args = parser.parse_args(argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="areal-patched-"))
    root.mkdir(parents=True, exist_ok=bool(not args.keep))
    try:
        results = apply_all(root)
        for name, ok, message in results:
            print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f"\n     {message}" if message else ""))
        compiled = compileall.compile_dir(root / "areal", quiet=1)
        print("byte-compiles" if compiled else "FAIL: the patched package does not compile")
        return 0 if compiled and all(ok for _, ok, _ in results) else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
