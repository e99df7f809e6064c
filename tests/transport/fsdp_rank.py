"""One rank of a real upstream FSDP actor (CPU, gloo) using the Hex bucket send; run in its own process."""

from __future__ import annotations

import json
import os


def run_rank(rank: int, world: int, port: int, model_dir: str, server: str, route: dict, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from areal.api.cli_args import InferenceEngineConfig, OptimizerConfig, PPOActorConfig
    from areal.api.io_struct import FinetuneSpec, WeightUpdateMeta
    from areal.engine.sglang_remote import RemoteSGLangEngine

    from areal_hex_plugin.transport import HexFSDPPPOActor

    config = PPOActorConfig(
        experiment_name="hex",
        trial_name="fsdp",
        path=model_dir,
        dtype="bfloat16",
        attn_impl="sdpa",
        optimizer=OptimizerConfig(),
        backend=f"fsdp:d{world}",
    )
    actor = HexFSDPPPOActor(config)
    actor.create_process_group()
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=8))
    rollout = RemoteSGLangEngine(
        InferenceEngineConfig(experiment_name="hex", trial_name="fsdp", pause_grace_period=0)
    )
    rollout.initialize(addr=server, train_data_parallel_size=1)
    meta = WeightUpdateMeta(type="xccl", weight_chunked_mem_mb=1)
    actor.connect_engine(rollout, meta)
    actor.hex_configure_transport(route, {"backend": "gloo", "timeout_s": 30.0})
    actor.update_weights(meta.with_version(3))
    report = actor.hex_commit()
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(report, handle)
    rollout.destroy()
    actor.destroy()
