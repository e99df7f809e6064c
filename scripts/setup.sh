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
n=0
step() { n=$((n + 1)); echo "set-up $n/5 (${SECONDS}s): $*" >&2; }  # progress: the whole set-up takes minutes
step "virtual environment .venv"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -qq --disable-pip-version-check)
# torch first and pinned: an unpinned torch (or uv) resolves to a multi-GB CUDA build (docs/install facts).
step "torch 2.13.0 (CPU)"
"${pip[@]}" "torch==2.13.0"
step "the plugin with its areal, plot and dev extras"
"${pip[@]}" -e ".[areal,plot,dev]"
# areal's own pins want CUDA torch 2.10; its import-time needs come from the [areal] extra above.
step "areal 1.0.4"
"${pip[@]}" --no-deps "areal==1.0.4"
step "compiling bytecode"
# Compiled bytecode makes `import areal` 3x faster when PYTHONDONTWRITEBYTECODE is set.
.venv/bin/python -m compileall -q -j 0 .venv/lib >/dev/null 2>&1 || true
rm -f .venv/.setup-*
touch "$stamp"
echo "set-up done: .venv (${SECONDS}s)"
