#!/usr/bin/env bash
# Create .venv at the repository root with the plugin, upstream AReaL 1.0.4 and the test tools.
#
# Usage: bash scripts/setup.sh                   CPU profile (development, CI): CPU torch, areal --no-deps
#        bash scripts/setup.sh --gpu             GPU profile: areal[sglang]==1.0.4 with upstream's own pins
#        bash scripts/setup.sh --gpu --megatron  GPU profile plus upstream's megatron extra (Python >= 3.12)
#        add --resolve to a GPU profile: print what it resolves to (name==version) and install nothing
#
# The GPU profiles install with uv and upstream AReaL's dependency overrides (scripts/gpu-overrides.txt; the areal
# wheel does not carry them, and without them areal[sglang] does not resolve) and the inference stack upstream's
# lock file pins (scripts/gpu-constraints.txt). PYTHON picks the interpreter for a new .venv; UV the uv for
# --resolve (default: .venv/bin/uv, else uv on PATH). Safe to run again: it does nothing when .venv is already set
# up for this profile, pyproject.toml and these files.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=cpu
megatron=0
resolve=0
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) profile=gpu; shift ;;
    --megatron) megatron=1; shift ;;
    --resolve) resolve=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$profile" = cpu ] && { [ "$megatron" = 1 ] || [ "$resolve" = 1 ]; }; then
  echo "setup.sh: --megatron and --resolve go with --gpu (see --help)" >&2
  exit 2
fi

uv_version=0.13.9
overrides=${HEX_GPU_OVERRIDES:-scripts/gpu-overrides.txt}  # the resolution test swaps in a file with one removed
constraints=scripts/gpu-constraints.txt
extras=gpu,dev
python_version=3.11
if [ "$megatron" = 1 ]; then
  extras=gpu,megatron,dev
  python_version=3.12  # megatron-core and megatron-bridge are marked python_version >= '3.12'
fi
uv_args=(--override "$overrides" --constraint "$constraints")

if [ "$resolve" = 1 ]; then
  uv=${UV:-}
  if [ -z "$uv" ]; then
    if [ -x .venv/bin/uv ]; then uv=.venv/bin/uv; else uv=uv; fi
  fi
  command -v "$uv" >/dev/null || { echo "setup.sh: no uv: pip install uv==$uv_version" >&2; exit 2; }
  extra_args=()
  IFS=, read -ra names <<< "$extras"
  for name in "${names[@]}"; do extra_args+=(--extra "$name"); done
  # GPU machines are Linux x86_64; packages are only resolved (metadata), never installed.
  exec "$uv" pip compile pyproject.toml "${extra_args[@]}" "${uv_args[@]}" --python-version "$python_version" \
    --python-platform x86_64-manylinux_2_28 --no-python-downloads --no-header --no-annotate
fi

python=${PYTHON:-python3}
inputs=(pyproject.toml scripts/setup.sh)
[ "$profile" = gpu ] && inputs+=("$overrides" "$constraints")
stamp=".venv/.setup-$profile-$megatron-$(cat "${inputs[@]}" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
for other in .venv/.setup-*; do  # a stamp without a profile name is a CPU set-up's
  [ -e "$other" ] || continue
  [[ "$other" == .venv/.setup-gpu-* ]] && had=gpu || had=cpu
  if [ "$had" != "$profile" ]; then
    echo "setup.sh: .venv holds the $had install profile; profiles are never mixed: remove .venv first" \
      "(rm -rf .venv)" >&2
    exit 2
  fi
done
n=0
steps=4
[ "$profile" = gpu ] && steps=3
step() { n=$((n + 1)); echo "set-up $n/$steps (${SECONDS}s): $*" >&2; }  # progress: the whole set-up takes minutes
step "virtual environment .venv"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -qq --disable-pip-version-check)
if [ "$profile" = gpu ]; then
  if [ "$megatron" = 1 ] && ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    echo "setup.sh: --megatron needs Python >= 3.12 (megatron-core 0.17.0): rm -rf .venv &&" \
      "PYTHON=python3.12 bash scripts/setup.sh --gpu --megatron" >&2
    exit 2
  fi
  step "the plugin with upstream's GPU stack (uv $uv_version, upstream's overrides)"
  "${pip[@]}" "uv==$uv_version"
  .venv/bin/uv pip install --python .venv/bin/python -e ".[$extras]" "${uv_args[@]}"
else
  # torch first and pinned: an unpinned torch (or uv) resolves to a multi-GB CUDA build (docs/install facts).
  step "torch 2.13.0 (CPU), the plugin with its areal, plot and dev extras"
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" -e ".[areal,plot,dev]"
  # areal's own pins want CUDA torch 2.10; its import-time needs come from the [areal] extra above.
  step "areal 1.0.4"
  "${pip[@]}" --no-deps "areal==1.0.4"
fi
step "compiling bytecode"
# Compiled bytecode makes `import areal` 3x faster when PYTHONDONTWRITEBYTECODE is set.
.venv/bin/python -m compileall -q -j 0 .venv/lib >/dev/null 2>&1 || true
rm -f .venv/.setup-*
touch "$stamp"
echo "set-up done: .venv ($profile profile, ${SECONDS}s)"
