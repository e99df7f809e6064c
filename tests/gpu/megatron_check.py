"""GPU check for asymmetric pipeline training on Megatron (run by hand; not collected by pytest).

    python -m pip install -e '.[gpu,megatron,dev]'   # upstream's pins; megatron-core needs Python >= 3.12
    python tests/gpu/megatron_check.py --json megatron_gpu.json

Needs 2 GPUs. Builds a tiny Qwen2 (6 layers, random weights, made locally) and starts upstream's Megatron PPO actor
as the plugin's ``HexMegatronPPOActor`` on ``megatron:d1p2t1`` twice: with the plan's split ``HEX_PP_LAYERS="5 1"``
and without it (upstream's parameter-balanced split). Each rank counts the decoder layers it built. Proves: the
planned per-stage layer counts reach megatron-core (5 and 1 layers), and without a plan upstream's own split runs.
Prints and writes JSON; exit 1 if a count is not the planned one. Not part of run_all.sh (it needs the megatron
extra and 2 GPUs; run_all.sh's checks fill its 10 minutes). Not yet run on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LAYERS = 6
PLANNED = (5, 1)


def _tiny_model(folder: str) -> str:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(folder)
    # Any small tokenizer saved locally works; the engine only loads it.
    AutoTokenizer.from_pretrained(os.environ.get("HEX_CHECK_TOKENIZER", "gpt2")).save_pretrained(folder)
    return folder


def _rank(rank: int, job: dict) -> None:
    import torch
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import PPOActorConfig
    from areal.api.io_struct import FinetuneSpec

    from areal_hex_plugin.areal.megatron_actor import HexMegatronPPOActor

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(job["port"]))  # fmt: skip
    if job["layers"]:
        os.environ["HEX_PP_LAYERS"] = job["layers"]
    config = PPOActorConfig(
        experiment_name="hex-megatron-check", trial_name="t", path=job["model"], backend="megatron:d1p2t1",
        dtype="bfloat16",
    )  # fmt: skip
    actor = HexMegatronPPOActor(config)
    actor.create_process_group(parallel_strategy=ModelAllocation.from_str(config.backend).parallel)
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=8))
    from megatron.core.transformer.transformer_layer import TransformerLayer

    built = sum(1 for chunk in actor.model for m in chunk.modules() if isinstance(m, TransformerLayer))
    Path(job["out"]).with_suffix(f".{rank}").write_text(json.dumps(built))
    torch.distributed.barrier()
    actor.destroy()


def _run(model: str, layers: str | None, folder: str) -> list[int]:
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = Path(folder) / f"layers-{layers or 'upstream'}"
    job = {"model": model, "layers": layers, "port": port, "out": str(out)}
    mp.start_processes(_rank, args=(job,), nprocs=2, join=True, start_method="spawn")
    return [json.loads(out.with_suffix(f".{r}").read_text()) for r in range(2)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    import torch

    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hex-megatron-check-") as folder:
        model = _tiny_model(str(Path(folder) / "model"))
        planned = _run(model, " ".join(map(str, PLANNED)), folder)
        upstream = _run(model, None, folder)
    result = {"planned": list(PLANNED), "built_with_plan": planned, "built_without_plan": upstream,
              "ok": tuple(planned) == PLANNED and sum(upstream) == LAYERS}  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.json).write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
