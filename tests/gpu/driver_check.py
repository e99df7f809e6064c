"""GPU check: a real one-node AReaL-Hex run of a tiny model through the driver (SGLang rollout, FSDP training).

Run on a machine with NVIDIA GPUs, sglang installed, and a local model and GSM8K copy (GPU machines here
reach no network):

    .venv/bin/python tests/gpu/driver_check.py --model /models/Qwen2.5-0.5B-Instruct --dataset /data/gsm8k

It discovers the local GPUs (nvidia-smi), writes a recipe whose cluster is this machine split into a train pool
and a rollout pool, runs ``python -m areal_hex_plugin.driver`` with ``scheduler.type=hex_local`` for a few
steps, and prints the ``hex/*`` metrics upstream's StatsLogger committed. On a one-GPU machine both roles
share the GPU (``HEX_LOCAL_SHARE_GPUS=1``, upstream's disk weight update); with more, weights go through the
relay transport (``hex.transport: relay``). Exit 0 when the run finished and
logged measured throughput; 2 when this machine cannot run the check (no GPU, no sglang).
"""

from __future__ import annotations

import argparse
import importlib.util
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
BASE_RECIPE = REPO / "recipes" / "paper" / "1.5b.yaml"


def local_gpus() -> tuple[str, int]:
    from areal_hex_plugin.errors import HexError
    from areal_hex_plugin.inventory import group_pools, machines_from_local

    try:
        pools = group_pools(machines_from_local())
    except HexError as exc:
        raise SystemExit(f"cannot run the GPU check here: {exc.message}") from None
    return pools[0].gpu_type, pools[0].gpus_per_machine


def write_recipe(folder: Path, model: str, dataset: str, gpu_type: str, n_gpus: int, steps: int) -> Path:
    recipe = yaml.safe_load(BASE_RECIPE.read_text())
    half = max(1, n_gpus // 2)
    shared = n_gpus == 1
    recipe.update(experiment_name="hex-gpu-check", trial_name="t0", total_train_steps=steps)
    recipe["cluster"].update(fileroot=str(folder / "exp"), n_gpus_per_node=n_gpus)
    recipe["cluster"]["name_resolve"]["nfs_record_root"] = str(folder / "nr")
    recipe["actor"].update(path=model, gradient_checkpointing=False)
    recipe["actor"]["mb_spec"]["max_tokens_per_mb"] = 4096
    recipe["gconfig"].update(n_samples=4, max_new_tokens=256, max_tokens=1280)
    recipe["sglang"].update(context_length=1280, mem_fraction_static=0.4 if shared else 0.6)
    if shared:
        # NCCL refuses two ranks on one GPU: upstream's disk update instead of the relay transport.
        recipe["actor"]["weight_update_mode"] = "disk"
        recipe["hex"]["transport"] = "upstream"
    recipe["train_dataset"].update(path=dataset, batch_size=8, max_length=512, num_workers=0)
    recipe["stats_logger"]["wandb"]["mode"] = "offline"
    recipe["hex"]["cluster"] = {
        # This one machine, split in two "machines" so the planner can give one to training, one to rollout.
        "pools": [
            {"name": f"part{i}", "gpu_type": gpu_type, "gpus_per_machine": half, "machines": 1,
             "price_per_gpu_hour": 1.0}
            for i in (0, 1)
        ],
    }  # fmt: skip
    recipe["hex"].pop("objective", None)
    recipe["hex"]["workload"] = {"model": model, "output_lengths": {"kind": "lognormal", "mean_tokens": 128}}
    (folder / "nr").mkdir(parents=True, exist_ok=True)
    path = folder / "gpu_check.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local HF model folder (a tiny one: 0.5B)")
    parser.add_argument("--dataset", required=True, help="local GSM8K folder")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=540, help="seconds for the whole run")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("sglang") is None:
        print("cannot run the GPU check here: sglang is not installed (pip install -e '.[gpu,dev]')")
        return 2
    gpu_type, n_gpus = local_gpus()
    folder = Path(tempfile.mkdtemp(prefix="hex-gpu-check-"))
    recipe = write_recipe(folder, args.model, args.dataset, gpu_type, n_gpus, args.steps)
    cmd = [
        sys.executable,
        "-m",
        "areal_hex_plugin.driver",
        "--config",
        str(recipe),
        "scheduler.type=hex_local",
    ]
    print("running:", " ".join(cmd), flush=True)
    # The relay transport (2+ GPUs) authenticates every peer with this shared secret.
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(folder),
        "AREAL_HEX_TRANSPORT_TOKEN": secrets.token_hex(16),
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
    metrics = sorted(set(re.findall(r"(hex/[\w/.-]+)\s*[│|]?\s*([-+0-9.e]+)", log)))
    for key, value in metrics:
        print(f"{key:45s} {value}")
    print(f"driver exit code {proc.returncode}; full log in {folder / 'driver.log'}")
    measured = any(key == "hex/measured/tokens_per_s" for key, _ in metrics)
    if proc.returncode != 0 or not measured:
        print(log[-6000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
