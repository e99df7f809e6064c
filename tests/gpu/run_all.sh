#!/usr/bin/env bash
# Run every GPU check in tests/gpu, in order, each under its own timeout, and write one JSON summary.
#
# Usage: bash tests/gpu/run_all.sh [--out DIR] [--model DIR --dataset DIR] [--tokenizer DIR] [--python PY]
#                                  [--force] [--help]
#
# Needs (on the GPU machine, from the repository root):
#   - NVIDIA GPU(s) with a working driver (nvidia-smi) and the GPU install profile in the Python used:
#       python -m pip install -e ".[gpu,dev]"     (upstream's own pins: areal 1.0.4, sglang 0.5.10.post1,
#                                                  CUDA torch 2.9.1; see CONTRIBUTING.md)
#     and for the megatron check also the `megatron` extra (".[gpu,megatron,dev]"; megatron-core, Python >= 3.12).
#   - for the driver check: a local Hugging Face model folder (a small one, e.g. Qwen2.5-0.5B-Instruct) and a local
#     GSM8K copy, given as --model/--dataset or HEX_GPU_MODEL/HEX_GPU_DATASET (GPU machines here reach no network).
#   - for the megatron check: 2 GPUs and a local tokenizer folder (--tokenizer, HEX_CHECK_TOKENIZER, else --model).
#   A check whose needs are missing is skipped, with the reason.
#
# The checks, in order (default timeouts add up to 540 s; with the probes (30 s + 2 x 5 s) and 5 s to kill each
# check that ignores its stop signal, 10 minutes at most):
#   transport (HEX_GPU_TIMEOUT_TRANSPORT, 60 s): tests/gpu/transport_check.py. The relay weight transport moves a
#       bf16 state dict held on the GPU to relay receivers bit-exactly over tcp and gloo, and over nccl on 2+ GPUs
#       (there also: the receiving side stages through pinned host buffers, reused by the next version's transfer).
#   profile (HEX_GPU_TIMEOUT_PROFILE, 180 s): tests/gpu/profile_check.py. `areal-hex profile` times a real SGLang
#       engine (the pinned sglang) and upstream's real FSDP PPO step on this GPU type with the 1.5B recipe's shape
#       (random weights, nothing downloaded) and fits efficiency factors inside sane ranges.
#   megatron (HEX_GPU_TIMEOUT_MEGATRON, 100 s): tests/gpu/megatron_check.py. Upstream's Megatron PPO actor on
#       megatron:d1p2t1 builds the plan's uneven pipeline split (5 + 1 layers of a tiny Qwen2) and, as the plugin's
#       HexMegatronRelayActor, updates a relay receiver bit-exactly with each stage sending its own layers; and
#       upstream's own split without a plan.
#   driver (HEX_GPU_TIMEOUT_DRIVER, 200 s): tests/gpu/driver_check.py. A real `python -m areal_hex_plugin.driver`
#       run with hex_local on this machine: SGLang rollout servers, FSDP training, weight updates (relay with 2+
#       GPUs, upstream's disk path on one), and measured hex/* metrics logged through upstream's StatsLogger.
#
# Each check is "passed", "failed", "timeout" or "skipped". A check that exits 2 says it cannot run on this
# machine: skipped, with its last message as the reason; so is a pytest run whose test skipped.
# The summary goes to DIR/summary.json (DIR: --out, else $OUT, else ./gpu-checks), each check's log to
# DIR/<check>.log. Exit 0 when no check failed or timed out (skipped checks included), 1 otherwise.
# --force runs every check even where the probes say it cannot run (to see its own message).
set -uo pipefail
cd "$(dirname "$0")/../.."

out=${OUT:-gpu-checks}
model=${HEX_GPU_MODEL:-}
dataset=${HEX_GPU_DATASET:-}
tokenizer=${HEX_CHECK_TOKENIZER:-}
py=${PYTHON:-}
force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --dataset) dataset=$2; shift 2 ;;
    --tokenizer) tokenizer=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
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
  timeout 5 "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" >/dev/null 2>&1
}
gpu_reason=""
gpus=0
if ! command -v nvidia-smi >/dev/null 2>&1; then
  gpu_reason="no CUDA GPU: nvidia-smi is not on PATH"
else
  gpus=$(timeout 30 "$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" \
    2>/dev/null || echo 0)
  [ "${gpus:-0}" -gt 0 ] 2>/dev/null || gpu_reason="no CUDA GPU: torch.cuda.is_available() is False in $py"
fi
sglang_reason=""
has sglang || sglang_reason="sglang is not installed in $py: install the GPU profile, pip install -e \".[gpu,dev]\""
model_reason=""
if [ -z "$model" ] || [ -z "$dataset" ]; then
  model_reason="needs a local model and GSM8K copy: --model DIR --dataset DIR (or HEX_GPU_MODEL, HEX_GPU_DATASET)"
fi
tokenizer=${tokenizer:-$model}
megatron_reason=""
if ! has megatron.core; then
  megatron_reason="megatron-core is not installed in $py: pip install -e \".[gpu,megatron,dev]\" (Python >= 3.12)"
elif [ "${gpus:-0}" -lt 2 ]; then
  megatron_reason="needs 2 GPUs (this machine has ${gpus:-0})"
elif [ -z "$tokenizer" ]; then
  megatron_reason="needs a local tokenizer folder: --tokenizer DIR (or HEX_CHECK_TOKENIZER, or --model)"
fi

# run NAME TIMEOUT_S SKIP_REASON COMMAND...: one check under its own timeout, its status appended to $results.
run() {
  local name=$1 limit=$2 reason=$3; shift 3
  local log="$out/$name.log" start end rc status
  if [ -n "$reason" ] && [ "$force" = 0 ]; then
    printf '%s\tskipped\t0\t\t%s\t%s\n' "$name" "$limit" "$reason" >> "$results"
    echo "[run_all] $name: skipped ($reason)"
    return
  fi
  echo "[run_all] $name: running (timeout ${limit}s): $*"
  start=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1
  rc=$?
  end=$(date +%s)
  case $rc in
    0) status=passed ;;
    2) status=skipped; reason=$(grep -v '^\s*$' "$log" | tail -n 1) ;;  # the check: "cannot run here"
    124|137) status=timeout ;;
    *) status=failed ;;
  esac
  # pytest exits 0 when its only test skipped: that is a skip, with pytest's reason.
  if [ $rc = 0 ] && grep -Eq '^[0-9]+ skipped' "$log" && ! grep -Eq '[0-9]+ passed' "$log"; then
    status=skipped
    reason=$(grep -m1 "^SKIPPED" "$log" | sed 's/^SKIPPED \[[0-9]*\] [^:]*:[0-9]*: //')
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$((end - start))" "$rc" "$limit" "$reason" >> "$results"
  echo "[run_all] $name: $status in $((end - start))s (log: $log)"
}

t_transport=${HEX_GPU_TIMEOUT_TRANSPORT:-60}
t_profile=${HEX_GPU_TIMEOUT_PROFILE:-180}
t_megatron=${HEX_GPU_TIMEOUT_MEGATRON:-100}
t_driver=${HEX_GPU_TIMEOUT_DRIVER:-200}
run transport "$t_transport" "$gpu_reason" \
  "$py" tests/gpu/transport_check.py --json "$out/transport.json" --gb 1
run profile "$t_profile" "${gpu_reason:-$sglang_reason}" \
  "$py" -m pytest -n 0 -m gpu tests/gpu/profile_check.py -q -rs -p no:cacheprovider
run megatron "$t_megatron" "${gpu_reason:-$megatron_reason}" \
  env HEX_CHECK_TOKENIZER="$tokenizer" "$py" tests/gpu/megatron_check.py --json "$out/megatron.json"
run driver "$t_driver" "${gpu_reason:-${sglang_reason:-$model_reason}}" \
  "$py" tests/gpu/driver_check.py --model "$model" --dataset "$dataset" --steps 2 --timeout $((t_driver - 20))

"$py" - "$results" "$out/summary.json" <<'EOF'
import json, shutil, socket, subprocess, sys, time
gpus = []
if shutil.which("nvidia-smi"):
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    gpus = [line.strip() for line in done.stdout.splitlines() if line.strip()]
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
checks = [
    {"name": name, "status": status, "seconds": int(seconds), "exit_code": int(rc) if rc else None,
     "timeout_s": int(limit), "reason": reason or None, "log": None if status == "skipped" and not rc
     else f"{name}.log"}
    for name, status, seconds, rc, limit, reason in rows
]
summary = {"host": socket.gethostname(), "gpus": gpus, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "ok": all(c["status"] in ("passed", "skipped") for c in checks), "checks": checks}
with open(sys.argv[2], "w") as f:
    json.dump(summary, f, indent=2)
    f.write("\n")
print(json.dumps({c["name"]: c["status"] for c in checks}))
EOF
rm -f "$results"
echo "[run_all] summary: $out/summary.json"
grep -q '"ok": true' "$out/summary.json"
