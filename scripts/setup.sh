#!/usr/bin/env bash
# Create .venv at the repository root with the plugin, upstream AReaL 1.0.4 and the test tools (CPU only).
# Safe to run again: it does nothing when .venv is already set up for this pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -qq --disable-pip-version-check)
# torch first and pinned: an unpinned torch (or uv) resolves to a multi-GB CUDA build (docs/install facts).
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[areal,plot,dev]"
# areal's own pins want CUDA torch 2.10; its import-time needs come from the [areal] extra above.
"${pip[@]}" --no-deps "areal==1.0.4"
# Compiled bytecode makes `import areal` 3x faster when PYTHONDONTWRITEBYTECODE is set.
.venv/bin/python -m compileall -q -j 0 .venv/lib >/dev/null 2>&1 || true
rm -f .venv/.setup-*
touch "$stamp"
echo "set-up done: .venv"
