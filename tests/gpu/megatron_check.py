"""GPU check for asymmetric pipeline training on Megatron, and the relay from its stages (run_all.sh runs it;
not collected by pytest).

    PYTHON=python3.12 bash scripts/setup.sh --gpu --megatron   # upstream's pins; megatron-core needs Python >= 3.12
    .venv/bin/python tests/gpu/megatron_check.py --json megatron_gpu.json

Needs 2 GPUs. Builds a tiny Qwen2 (6 layers, random bf16 weights, and a tokenizer trained locally: nothing is
downloaded) and starts upstream's Megatron PPO actor on ``megatron:d1p2t1`` twice: as the plugin's
``HexMegatronRelayActor`` with the plan's split ``HEX_PP_LAYERS="5 1"``, and as ``HexMegatronPPOActor`` without it
(upstream's parameter-balanced split). Each rank counts the decoder layers it built. In the planned run the actor
then updates a relay receiver (a ``RelayReceiverMixin`` engine in this process, loading into the SGLang stand-in of
``tests/transport``) through upstream's own Megatron-to-HF conversion, each stage's head sending the layers it
holds. Proves: the planned per-stage layer counts reach megatron-core (5 and 1 layers), without a plan upstream's
own split runs, and the relay from the two stages commits the checkpoint's exact bytes with each stage sending its
own layers (``part_bytes``). Prints and writes JSON; exit 1 if a count is not the planned one or the relay's
weights or parts differ; exit 2 (run_all.sh: skipped, which counts as not ok unless ``--allow-skip megatron``) with
fewer than 2 GPUs. Not yet run on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LAYERS = 6
PLANNED = (5, 1)


def _tiny_model(folder: str) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.e2e.assets import build_tokenizer

    config = Qwen2Config(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    build_tokenizer(config.vocab_size).save_pretrained(folder)  # the engine only loads it
    return folder


def _rank(rank: int, job: dict) -> None:
    import torch
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import PPOActorConfig
    from areal.api.io_struct import FinetuneSpec

    from areal_hex_plugin.areal.megatron_actor import HexMegatronPPOActor, HexMegatronRelayActor

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(job["port"]))  # fmt: skip
    if job["layers"]:
        os.environ["HEX_PP_LAYERS"] = job["layers"]
    config = PPOActorConfig(
        experiment_name="hex-megatron-check", trial_name="t", path=job["model"], backend="megatron:d1p2t1",
        dtype="bfloat16",
    )  # fmt: skip
    actor = (HexMegatronRelayActor if job["route"] else HexMegatronPPOActor)(config)
    actor.create_process_group(parallel_strategy=ModelAllocation.from_str(config.backend).parallel)
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=8))
    from megatron.core.transformer.transformer_layer import TransformerLayer

    built = sum(1 for chunk in actor.model for m in chunk.modules() if isinstance(m, TransformerLayer))
    report = _relay_update(actor, job) if job["route"] else None
    Path(job["out"]).with_suffix(f".{rank}").write_text(json.dumps({"built": built, "relay": report}))
    torch.distributed.barrier()
    actor.destroy()


def _relay_update(actor, job: dict) -> dict | None:
    """Version 1 through the relay (rank 0's report; None on the other rank)."""
    from areal.api.cli_args import InferenceEngineConfig
    from areal.api.io_struct import WeightUpdateMeta
    from areal.engine.sglang_remote import RemoteSGLangEngine

    rollout = RemoteSGLangEngine(
        InferenceEngineConfig(experiment_name="hex-megatron-check", trial_name="t", pause_grace_period=0)
    )
    rollout.initialize(addr=job["server"], train_data_parallel_size=1)
    meta = WeightUpdateMeta(type="xccl", weight_chunked_mem_mb=1)
    actor.connect_engine(rollout, meta)
    actor.hex_configure_transport(job["route"], {"backend": "tcp", "timeout_s": 60.0})
    actor.update_weights(meta.with_version(1))
    report = actor.hex_commit()
    rollout.destroy()
    return report


def _run(model: str, layers: str | None, folder: str, relay: tuple[str, dict] | None = None) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = Path(folder) / f"layers-{layers or 'upstream'}"
    server, route = relay or (None, None)
    job = {"model": model, "layers": layers, "port": port, "out": str(out), "server": server, "route": route}
    mp.start_processes(_rank, args=(job,), nprocs=2, join=True, start_method="spawn")
    return [json.loads(out.with_suffix(f".{r}").read_text()) for r in range(2)]


def _relay_receiver(folder: str):
    """The SGLang stand-in and a relay receiver engine in front of it (this process)."""
    from areal.api.cli_args import InferenceEngineConfig

    from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route
    from tests.transport.receiver_engine import ReceiverEngine
    from tests.transport.sglang_standin import SGLangStandIn

    server = SGLangStandIn(tp_size=1)
    engine = ReceiverEngine(
        InferenceEngineConfig(experiment_name="hex-megatron-check", trial_name="r", pause_grace_period=0)
    )
    engine.initialize(addr=server.address, train_data_parallel_size=1)
    endpoint = engine.hex_start_receiver(bind_host="127.0.0.1", stage_dir=str(Path(folder) / "stage"))
    route = Route([PoolRoute("rollout", [Endpoint.parse(endpoint)], 1.5, 5.0)]).to_dict()
    return server, engine, route


def _relay_result(model: str, server, report: dict | None) -> dict:
    """Whether the stand-in holds the checkpoint's exact tensors, and each stage's bytes against its layers."""
    import torch
    from safetensors.torch import load_file

    from tests.transport.stage_rank import stage_tensors

    expected = {}
    for path in Path(model).glob("*.safetensors"):
        expected.update(load_file(str(path)))
    held = server.model.shards[0]
    exact = set(held) == set(expected) and all(torch.equal(held[n], t) for n, t in expected.items())
    stages = [
        sum(t.numel() * t.element_size() for _, t in stage_tensors(expected, PLANNED, k)) for k in range(2)
    ]
    sent = (report or {}).get("part_bytes")
    return {"bit_exact": exact, "part_bytes": sent, "stage_bytes": stages, "ok": exact and sent == stages}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    import torch

    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    os.environ.setdefault("AREAL_HEX_TRANSPORT_TOKEN", secrets.token_hex(16))
    with tempfile.TemporaryDirectory(prefix="hex-megatron-check-") as folder:
        model = _tiny_model(str(Path(folder) / "model"))
        server, engine, route = _relay_receiver(folder)
        try:
            planned = _run(model, " ".join(map(str, PLANNED)), folder, (server.address, route))
            relay = _relay_result(model, server, planned[0]["relay"])
        finally:
            engine.hex_stop_receiver()
            engine.destroy()
            server.close()
        upstream = [rank["built"] for rank in _run(model, None, folder)]
    built = [rank["built"] for rank in planned]
    result = {"planned": list(PLANNED), "built_with_plan": built, "built_without_plan": upstream, "relay": relay,
              "ok": tuple(built) == PLANNED and sum(upstream) == LAYERS and relay["ok"]}  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.json).write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
