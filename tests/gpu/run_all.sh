#!/usr/bin/env bash
# Run every GPU check in tests/gpu, in order, each under its own timeout, and print one JSON summary.
#
# Usage: bash tests/gpu/run_all.sh [--out DIR] [--python PY] [--allow-skip NAME[,NAME...]] [--force] [--help]
#
# Needs (on the GPU machine, from the repository root): NVIDIA GPU(s) with a working driver and the GPU install
# profile in the Python used (default .venv/bin/python):
#     bash scripts/setup.sh --gpu                 (upstream's own pins: areal 1.0.4, sglang 0.5.10.post1, CUDA torch
#                                                  2.9.1, with upstream's dependency overrides; see CONTRIBUTING.md)
#     PYTHON=python3.12 bash scripts/setup.sh --gpu --megatron      (also megatron-core, for the megatron check)
# No network and no model or dataset download: each check makes its own tiny model (random weights) and its own
# synthetic data.
#
# The checks, in order (each has its timeout; the whole run stops starting checks, and cuts a check's timeout,
# so that it ends within HEX_GPU_DEADLINE seconds, 530 by default: under 9 minutes):
#   transport (HEX_GPU_TIMEOUT_TRANSPORT, 120 s): tests/gpu/transport_check.py. The relay weight transport moves a
#       bf16 state dict held on the GPU to relay receivers in other processes bit-exactly over NCCL (on one GPU:
#       the receivers share it, each process with its own NCCL host identity), tcp and gloo, from one sender and
#       from two; and one NCCL data link's throughput with pinned staging reused across versions.
#   profile (HEX_GPU_TIMEOUT_PROFILE, 150 s): tests/gpu/profile_check.py. `areal-hex profile` times a real SGLang
#       engine (the pinned sglang) and upstream's real FSDP PPO step on this GPU type with the 1.5B recipe's shape
#       (random weights, made locally) and fits efficiency factors inside sane ranges.
#   megatron (HEX_GPU_TIMEOUT_MEGATRON, 90 s): tests/gpu/megatron_check.py. Upstream's Megatron PPO actor on
#       megatron:d1p2t1 builds the plan's uneven pipeline split (5 + 1 layers of a tiny Qwen2 with a tokenizer
#       made locally) and, as the plugin's HexMegatronRelayActor, updates a relay receiver bit-exactly with each
#       stage sending its own layers; and upstream's own split without a plan. Needs 2 GPUs and megatron-core.
#   driver (HEX_GPU_TIMEOUT_DRIVER, 180 s): tests/gpu/driver_check.py. A real `python -m areal_hex_plugin.driver`
#       run with hex_local on this machine: a tiny Qwen2 and arithmetic prompts made locally, SGLang rollout
#       servers, FSDP training, weight updates through the relay transport (on one GPU, trainer and server share
#       it by memory fraction), and measured hex/* metrics logged through upstream's StatsLogger.
#   learn (HEX_GPU_TIMEOUT_LEARN, 150 s): tests/gpu/learn_check.py. The CPU e2e's learning run (GRPO on the
#       target-token task, tests/e2e/target_reward.py) through the driver with real SGLang: the last steps' reward
#       must clear the CPU test's threshold, beyond chance.
#
# Each check ends "passed", "failed", "timeout" or "skipped". A check that needs sglang where it is not installed
# fails ("sglang not installed"). A check that cannot run on this machine (too few GPUs, no megatron-core; a check
# that exits 2, or a pytest run whose test skipped) is skipped, with the reason; a skipped check counts as not ok
# unless --allow-skip names it. Without a GPU nothing runs: "no GPU: nothing ran", exit 1.
# The summary is printed and written to DIR/summary.json (DIR: --out, else $OUT, else ./gpu-checks), each check's
# log to DIR/<check>.log. Exit 0 when every check passed (or was skipped and allowed to), 1 otherwise.
# --force runs every check even where the probes say it cannot run (to see its own message).
set -uo pipefail
cd "$(dirname "$0")/../.."

started=$(date +%s)
deadline=$((started + ${HEX_GPU_DEADLINE:-530}))
out=${OUT:-gpu-checks}
py=${PYTHON:-}
allowed=""
force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --allow-skip) allowed="$allowed,$2"; shift 2 ;;
    --force) force=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_all.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
mkdir -p "$out"
results="$out/.results.tsv"
: > "$results"

# What this machine has, probed once (each probe is bounded: a broken driver must not hang the run).
has() {  # has MODULE: whether $py finds the module (without importing it)
  timeout 10 "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" >/dev/null 2>&1
}
gpu_reason=""
gpus=0
if ! command -v nvidia-smi >/dev/null 2>&1; then
  gpu_reason="nvidia-smi is not on PATH"
else
  gpus=$(timeout 60 "$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" \
    2>/dev/null || echo 0)
  [ "${gpus:-0}" -gt 0 ] 2>/dev/null || gpu_reason="torch.cuda.is_available() is False in $py"
fi
sglang_missing=""
has sglang || sglang_missing="sglang not installed in $py: bash scripts/setup.sh --gpu"
megatron_reason=""
if ! has megatron.core; then
  megatron_reason="megatron-core is not installed in $py: PYTHON=python3.12 bash scripts/setup.sh --gpu --megatron"
elif [ "${gpus:-0}" -lt 2 ]; then
  megatron_reason="needs 2 GPUs (this machine has ${gpus:-0})"
fi

# run NAME TIMEOUT_S NEEDS COMMAND...: one check under its own timeout (cut to what the deadline leaves), its
# status appended to $results. NEEDS: "" (runs), "skip:REASON" or "fail:REASON" (does not run, unless --force).
run() {
  local name=$1 limit=$2 needs=$3; shift 3
  local log="$out/$name.log" start end rc status reason="" left
  if [ -n "$gpu_reason" ] && [ "$force" = 0 ]; then
    printf '%s\tnot run\t0\t\t%s\tno GPU: %s\n' "$name" "$limit" "$gpu_reason" >> "$results"
    return
  fi
  if [ -n "$needs" ] && [ "$force" = 0 ]; then
    status=${needs%%:*}; reason=${needs#*:}
    [ "$status" = fail ] && status=failed || status=skipped
    printf '%s\t%s\t0\t\t%s\t%s\n' "$name" "$status" "$limit" "$reason" >> "$results"
    echo "[run_all] $name: $status ($reason)" >&2
    return
  fi
  left=$((deadline - $(date +%s) - 10))  # 10 s: the kill-after and the summary
  if [ "$left" -lt 20 ]; then
    reason="not started: the run's deadline (HEX_GPU_DEADLINE) left no time"
    printf '%s\ttimeout\t0\t\t%s\t%s\n' "$name" "$limit" "$reason" >> "$results"
    echo "[run_all] $name: not started (deadline)" >&2
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "[run_all] $name: running (timeout ${limit}s): $*" >&2
  start=$(date +%s)
  HEX_CHECK_TIMEOUT=$limit timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1
  rc=$?
  end=$(date +%s)
  case $rc in
    0) status=passed ;;
    2) status=skipped; reason=$(grep -v '^\s*$' "$log" | tail -n 1) ;;  # the check: "cannot run here"
    124|137) status=timeout ;;
    *) status=failed; reason=$(grep -m1 -E '^failed: ' "$log") ;;
  esac
  # pytest exits 0 when its only test skipped: that is a skip, with pytest's reason.
  if [ $rc = 0 ] && grep -Eq '^[0-9]+ skipped' "$log" && ! grep -Eq '[0-9]+ passed' "$log"; then
    status=skipped
    reason=$(grep -m1 "^SKIPPED" "$log" | sed 's/^SKIPPED \[[0-9]*\] [^:]*:[0-9]*: //')
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$((end - start))" "$rc" "$limit" "$reason" >> "$results"
  echo "[run_all] $name: $status in $((end - start))s (log: $log)" >&2
}

needs_sglang=${sglang_missing:+fail:$sglang_missing}
run transport "${HEX_GPU_TIMEOUT_TRANSPORT:-120}" "" \
  "$py" tests/gpu/transport_check.py --json "$out/transport.json" --gb 0.25
run profile "${HEX_GPU_TIMEOUT_PROFILE:-150}" "$needs_sglang" \
  "$py" -m pytest -n 0 -m gpu tests/gpu/profile_check.py -q -rs -p no:cacheprovider
run megatron "${HEX_GPU_TIMEOUT_MEGATRON:-90}" "${megatron_reason:+skip:$megatron_reason}" \
  "$py" tests/gpu/megatron_check.py --json "$out/megatron.json"
run driver "${HEX_GPU_TIMEOUT_DRIVER:-180}" "$needs_sglang" \
  "$py" tests/gpu/driver_check.py --steps 2
run learn "${HEX_GPU_TIMEOUT_LEARN:-150}" "$needs_sglang" \
  "$py" tests/gpu/learn_check.py --json "$out/learn.json" --timeout 140

nothing_ran=""
[ "$force" = 0 ] && nothing_ran=$gpu_reason
"$py" - "$results" "$out/summary.json" "$allowed" "$nothing_ran" "$(($(date +%s) - started))" <<'EOF'
import json, shutil, socket, subprocess, sys, time
results, path, allowed, no_gpu, seconds = sys.argv[1:]
allowed = {name for name in allowed.split(",") if name}
gpus = []
if shutil.which("nvidia-smi"):
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    gpus = [line.strip() for line in done.stdout.splitlines() if line.strip()]
rows = [line.rstrip("\n").split("\t") for line in open(results) if line.strip()]
checks = []
for name, status, took, rc, limit, reason in rows:
    ok = status == "passed" or (status == "skipped" and name in allowed)
    checks.append({"name": name, "status": status, "ok": ok, "seconds": int(took),
                   "exit_code": int(rc) if rc else None, "timeout_s": int(limit), "reason": reason or None,
                   "log": f"{name}.log" if rc else None})
summary = {"host": socket.gethostname(), "gpus": gpus, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "seconds": int(seconds), "ok": bool(checks) and all(c["ok"] for c in checks),
           "allowed_skips": sorted(allowed), "checks": checks}
if no_gpu:
    summary["nothing_ran"] = f"no GPU: nothing ran ({no_gpu})"
with open(path, "w") as f:
    json.dump(summary, f, indent=2)
    f.write("\n")
print(json.dumps(summary, indent=2))
EOF
rm -f "$results"
echo "[run_all] summary: $out/summary.json" >&2
if [ -n "$gpu_reason" ] && [ "$force" = 0 ]; then
  echo "no GPU: nothing ran ($gpu_reason)" >&2
  exit 1
fi
grep -q '^  "ok": true' "$out/summary.json"
