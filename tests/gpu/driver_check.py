"""GPU check: a real one-node AReaL-Hex run of a tiny model through the driver (SGLang rollout, FSDP training, the
relay transport), with nothing downloaded.

Run on a machine with NVIDIA GPUs and the GPU install profile (``bash scripts/setup.sh --gpu``):

    .venv/bin/python tests/gpu/driver_check.py [--steps 2] [--timeout 160]

It makes a tiny Qwen2 (random bf16 weights, head_dim 64 so SGLang's attention kernels take it) with a tokenizer
trained locally, and GSM8K-shaped arithmetic prompts (``tests/e2e/assets.py``); writes a recipe from
``recipes/ci/tiny.yaml`` whose cluster is this machine split into two pools, so the planner gives one to training
and one to rollout; and runs ``python -m areal_hex_plugin.driver`` with ``scheduler.type=hex_local``. Weights go
through the relay transport (``hex.transport: relay``, tcp data links) on any GPU count: on a one-GPU machine the
trainer and the SGLang server share the GPU (``HEX_LOCAL_SHARE_GPUS=1``, SGLang's ``mem_fraction_static`` 0.3).
Exit 0 when the run finished, every weight update reached every replica through the relay, and upstream's
StatsLogger logged measured hex/* throughput; 1 otherwise (``failed: sglang not installed`` without sglang).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
BASE_RECIPE = REPO / "recipes" / "ci" / "tiny.yaml"
# A tiny Qwen2 whose head_dim (64) SGLang's GPU attention backends (FlashAttention 3, FlashInfer) support.
MODEL = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512,
         "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}  # fmt: skip
RELAY_UPDATE = re.compile(
    r"weights v(\d+): .* to (\d+)/(\d+) replicas .*; (\d+) parts, digest ([0-9a-f]{64})"
)


def local_gpus() -> tuple[str, int]:
    from areal_hex_plugin.errors import HexError
    from areal_hex_plugin.inventory import group_pools, machines_from_local

    try:
        pools = group_pools(machines_from_local())
    except HexError as exc:
        raise SystemExit(f"cannot run the GPU check here: {exc.message}") from None
    return pools[0].gpu_type, pools[0].gpus_per_machine


def write_model(folder: Path) -> Path:
    """The tiny Qwen2 (random bf16 weights) and a tokenizer trained here, as an HF model folder."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from tests.e2e.assets import build_tokenizer

    config = Qwen2Config(**MODEL, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=0)
    model.save_pretrained(folder)
    build_tokenizer(config.vocab_size).save_pretrained(folder)
    return folder


def write_recipe(folder: Path, gpu_type: str, n_gpus: int, steps: int) -> Path:
    from tests.e2e.assets import write_dataset

    model = write_model(folder / "model")
    dataset = write_dataset(folder / "gsm8k")
    recipe = yaml.safe_load(BASE_RECIPE.read_text())
    shared = n_gpus == 1
    recipe.update(experiment_name="hex-gpu-check", trial_name="t0", total_train_steps=steps)
    recipe["cluster"].update(fileroot=str(folder / "exp"), n_gpus_per_node=n_gpus)
    recipe["cluster"]["name_resolve"]["nfs_record_root"] = str(folder / "nr")
    for spec in recipe["rollout"]["scheduling_spec"]:
        spec["env_vars"] = {}  # real SGLang servers (the CPU recipe starts its stand-in)
    recipe["actor"]["path"] = str(model)
    recipe["train_dataset"]["path"] = str(dataset)
    recipe["recover"]["mode"] = "disabled"
    recipe["sglang"].update(mem_fraction_static=0.3 if shared else 0.6, disable_cuda_graph=True)
    recipe["hex"].pop("gpu_catalog", None)  # the real GPU type, from the built-in catalog
    half = max(1, n_gpus // 2)
    recipe["hex"]["cluster"] = {
        # This one machine, split in two "machines" so the planner can give one to training, one to rollout.
        "pools": [
            {"name": f"part{i}", "gpu_type": gpu_type, "gpus_per_machine": half, "machines": 1,
             "price_per_gpu_hour": 1.0}
            for i in (0, 1)
        ],
    }  # fmt: skip
    recipe["hex"]["workload"]["model"] = str(model)
    recipe["hex"]["solver"]["max_update_window"] = 1  # a weight update through the relay after every step
    recipe["hex"]["relay"].update(stage_dir=str(folder / "stage"), rollback_dir=str(folder / "rollback"))
    (folder / "nr").mkdir(parents=True, exist_ok=True)
    path = folder / "gpu_check.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def verdict(returncode: int | None, log: str) -> dict:
    """What the run proved: finished, every relay update committed on every replica, measured throughput."""
    metrics = dict(re.findall(r"(hex/[\w/.-]+)\s*[│|]?\s*([-+0-9.e]+)", log))
    updates = [
        {"version": int(v), "committed": int(c), "replicas": int(r), "parts": int(p)}
        for v, c, r, p, _ in RELAY_UPDATE.findall(log)
    ]
    ok = (
        returncode == 0
        and bool(updates)
        and all(u["committed"] == u["replicas"] for u in updates)
        and "hex/measured/tokens_per_s" in metrics
    )
    return {"ok": ok, "exit_code": returncode, "relay_updates": updates, "metrics": metrics}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    default_timeout = int(os.environ.get("HEX_CHECK_TIMEOUT", 560)) - 20  # run_all.sh's limit for this check
    parser.add_argument("--timeout", type=int, default=default_timeout, help="seconds for the whole run")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("sglang") is None:
        print("failed: sglang not installed (bash scripts/setup.sh --gpu)")
        return 1
    gpu_type, n_gpus = local_gpus()
    folder = Path(tempfile.mkdtemp(prefix="hex-gpu-check-"))
    recipe = write_recipe(folder, gpu_type, n_gpus, args.steps)
    cmd = [
        sys.executable,
        "-m",
        "areal_hex_plugin.driver",
        "--config",
        str(recipe),
        "scheduler.type=hex_local",
    ]
    print("running:", " ".join(cmd), flush=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(folder),
        "AREAL_HEX_TRANSPORT_TOKEN": secrets.token_hex(16),  # the relay authenticates every peer with it
    }
    if n_gpus == 1:
        env["HEX_LOCAL_SHARE_GPUS"] = "1"
    # A session of its own, so that a timeout ends the SGLang servers and workers the driver started too.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        log += f"\n[driver_check] killed after {args.timeout}s\n"
    (folder / "driver.log").write_text(log)
    result = verdict(proc.returncode, log)
    print(json.dumps(result, indent=2))
    print(f"full log in {folder / 'driver.log'}")
    if not result["ok"]:
        print(log[-6000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
