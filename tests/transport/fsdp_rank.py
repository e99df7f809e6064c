"""One rank of a real upstream FSDP actor (CPU, gloo) using the Hex bucket send; run in its own process."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def _engines(rank: int, world: int, port: int, model_dir: str, server: str, actor_cls=None):
    """This rank's upstream FSDP actor (``actor_cls``, by default the plugin's HexFSDPPPOActor), initialised,
    and a rollout engine on ``server``."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from areal.api.cli_args import InferenceEngineConfig, OptimizerConfig, PPOActorConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.sglang_remote import RemoteSGLangEngine

    if actor_cls is None:
        from areal_hex_plugin.transport import HexFSDPPPOActor as actor_cls

    config = PPOActorConfig(
        experiment_name="hex",
        trial_name="fsdp",
        path=model_dir,
        dtype="bfloat16",
        attn_impl="sdpa",
        optimizer=OptimizerConfig(),
        backend=f"fsdp:d{world}",
    )
    actor = actor_cls(config)
    actor.create_process_group()
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=8))
    rollout = RemoteSGLangEngine(
        InferenceEngineConfig(experiment_name="hex", trial_name="fsdp", pause_grace_period=0)
    )
    rollout.initialize(addr=server, train_data_parallel_size=1)
    return actor, rollout


def _actor(rank: int, world: int, port: int, model_dir: str, server: str, route: dict):
    from areal.api.io_struct import WeightUpdateMeta

    actor, rollout = _engines(rank, world, port, model_dir, server)
    meta = WeightUpdateMeta(type="xccl", weight_chunked_mem_mb=1)
    actor.connect_engine(rollout, meta)
    actor.hex_configure_transport(route, {"backend": "gloo", "timeout_s": 30.0})
    return actor, rollout, meta


def run_rank(rank: int, world: int, port: int, model_dir: str, server: str, route: dict, out: str) -> None:
    actor, rollout, meta = _actor(rank, world, port, model_dir, server, route)
    actor.update_weights(meta.with_version(3))
    report = actor.hex_commit()
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(report, handle)
    rollout.destroy()
    actor.destroy()


def _corrupt_every_chunk() -> None:
    """This process's data links, of every kind (gloo's bytes go on the connection itself), flip the first byte of
    every chunk they send (after its digest was taken)."""
    from areal_hex_plugin.transport import links

    for link in (links.SocketLink, links.TorchLink):
        send = link.send

        def corrupted(self, chunk, send=send):
            bad = chunk.clone()
            bad[0] ^= 0xFF
            send(self, bad)

        link.send = corrupted


def run_rank_expecting_failure(
    rank: int,
    world: int,
    port: int,
    model_dir: str,
    server: str,
    route: dict,
    out: str,
    corrupt: bool = False,
) -> None:
    """Writes the error each rank's update raised to ``out``.rank; a rank that failed stays up (as a trainer
    that catches it would) until every rank has written, so a rank stuck in a collective is not freed by it.
    ``corrupt``: this rank's part is corrupted after its digests were taken."""
    if corrupt:
        _corrupt_every_chunk()
    actor, rollout, meta = _actor(rank, world, port, model_dir, server, route)
    try:
        actor.update_weights(meta.with_version(3))
        error = "no error"
    except Exception as failure:  # noqa: BLE001 - the outcome is what the test checks
        error = f"{type(failure).__name__}: {failure}"
    Path(f"{out}.{rank}").write_text(error)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(Path(f"{out}.{r}").exists() for r in range(world)):
        time.sleep(0.2)
    rollout.destroy()
    actor.destroy()


def run_registry_rank(rank: int, world: int, port: int, model_dir: str, server: str, options: dict) -> None:
    """One rank of upstream's own FSDP actor (no plugin subclass) under ``weight_update_mode: hex_relay``, in an
    AReaL with ``patches/`` applied: upstream's engine finds the relay in its transport registry, where the
    plugin's entry point put it (this process never calls ``register()``)."""
    from areal.api.io_struct import WeightUpdateMeta
    from areal.engine.fsdp_engine import FSDPPPOActor

    actor, rollout = _engines(rank, world, port, model_dir, server, FSDPPPOActor)
    meta = WeightUpdateMeta(type="hex_relay", weight_chunked_mem_mb=1, transport_options=options)
    actor.connect_engine(rollout, meta)
    actor.update_weights(meta.with_version(3))
    rollout.destroy()
    actor.destroy()
