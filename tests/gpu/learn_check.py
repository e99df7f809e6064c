"""GPU check: the CPU end-to-end learning run (``tests/e2e/test_grpo_e2e.py``, hex_local) on this machine's GPUs,
with real SGLang servers in place of the CPU stand-in.

    .venv/bin/python tests/gpu/learn_check.py [--json OUT] [--steps 20] [--timeout 300]

Everything is made locally (``tests/e2e/assets.py``: the tiny random Qwen2, its tokenizer, the GSM8K-shaped set;
nothing downloaded). The recipe is ``recipes/ci/tiny.yaml`` with this machine as its cluster (split in two pools of
the local GPU type, as ``driver_check.py`` does: on one GPU the trainer and the server share it, with upstream's
disk weight update; on more, weights go through the relay), SGLang started for real (Triton attention: the tiny
model's 16-wide heads) and the same task, reward, optimiser and steps. The driver runs with ``hex_local``; the
check reads upstream's logged task reward per step (offline wandb) and the trained weights (the recover
checkpoint), and applies the CPU test's criterion (``tests/e2e/target_reward.py`` ``learning``): the last 4 steps'
mean reward reaches 0.45 from the initial ~0.25, beyond chance, and so does the trained policy's exact expected
reward. Prints one JSON object (the curve, the means, the chance bound, ``passed``); exit 0 when it learnt, 1 when
it did not or the run failed, 2 when this machine cannot run it (no GPU, no sglang).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.e2e.run import MARK, RECIPE, new_mark, run_driver  # noqa: E402
from tests.e2e.target_reward import LEARN_STEPS, learning, prompt_ids, target_probability  # noqa: E402


def local_gpus() -> tuple[str, int] | None:
    """This machine's GPU type and count (nvidia-smi), or None without one."""
    from areal_hex_plugin.errors import HexError
    from areal_hex_plugin.inventory import group_pools, machines_from_local

    try:
        pools = group_pools(machines_from_local())
    except HexError as exc:
        print(f"cannot run the GPU check here: {exc.message}")
        return None
    return pools[0].gpu_type, pools[0].gpus_per_machine


def write_recipe(folder: Path, gpu_type: str, n_gpus: int) -> Path:
    """``recipes/ci/tiny.yaml`` on this machine's GPUs with real SGLang."""
    recipe = yaml.safe_load(RECIPE.read_text())
    shared = n_gpus == 1
    half = max(1, n_gpus // 2)
    recipe["cluster"]["n_gpus_per_node"] = n_gpus
    for spec in recipe["rollout"]["scheduling_spec"]:
        spec["env_vars"] = {}  # SGLang itself, not the CPU stand-in
    recipe["sglang"].update(attention_backend="triton", mem_fraction_static=0.3 if shared else 0.6)
    if shared:
        # NCCL refuses two ranks on one GPU: upstream's disk weight update instead of the relay.
        recipe["actor"]["weight_update_mode"] = "disk"
        recipe["hex"]["transport"] = "upstream"
    hex_cfg = recipe["hex"]
    hex_cfg.pop("gpu_catalog")  # a real type: the catalog's figures
    hex_cfg["workload"]["model"] = str(REPO / "recipes" / "ci" / "tiny-qwen2")
    hex_cfg["cluster"] = {
        # This one machine, split in two "machines" so the planner can give one to training, one to rollout.
        "pools": [
            {"name": f"part{i}", "gpu_type": gpu_type, "gpus_per_machine": half, "machines": 1,
             "price_per_gpu_hour": 1.0}
            for i in (0, 1)
        ],
    }  # fmt: skip
    path = folder / "learn_check.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--steps", type=int, default=LEARN_STEPS)
    parser.add_argument("--timeout", type=int, default=300, help="seconds for the driver run")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("sglang") is None:
        print("cannot run the GPU check here: sglang is not installed (the GPU install profile)")
        return 2
    found = local_gpus()
    if found is None:
        return 2
    gpu_type, n_gpus = found
    folder = Path(tempfile.mkdtemp(prefix="hex-learn-check-"))
    recipe = write_recipe(folder, gpu_type, n_gpus)
    env = {
        **os.environ,
        MARK: new_mark(),
        "PYTHONPATH": str(REPO),  # the reward's module, in the rollout workers
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(folder),
        "AREAL_HEX_TRANSPORT_TOKEN": secrets.token_hex(16),
    }
    if n_gpus == 1:
        env["HEX_LOCAL_SHARE_GPUS"] = "1"
    run = run_driver(folder, "hex_local", args.steps, env, args.timeout, recipe=recipe)
    result = dict(gpu_type=gpu_type, gpus=n_gpus, seconds=round(run.seconds, 1), exit_code=run.returncode)
    result["log"] = str(folder / "driver.log")
    if run.returncode == 0:
        rows = [row for row in run.wandb_history() if any(k.startswith("hex/measured/") for k in row)]
        prompts = prompt_ids(folder / "model", folder / "gsm8k")
        initial = target_probability(None, folder / "model", prompts)
        trained = target_probability(run.trainer_weights(), folder / "model", prompts)
        result.update(steps=len(rows), **learning(rows, initial, trained))
        result["passed"] = result["passed"] and len(rows) == args.steps
    else:
        print(run.log[-6000:])
        result["passed"] = False
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
