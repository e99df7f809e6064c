"""One pipeline stage's head standing in for a Megatron actor (gloo world, its own process): the train-side
seams of the relay (RelayTrainSide, as HexMegatronRelayActor uses them) with the HF tensors of the layers the
stage holds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from areal_hex_plugin.areal.megatron_layout import layer_stage
from areal_hex_plugin.transport.train_side import RelayTrainSide
from areal_hex_plugin.transport.wire import TransportError


class StageHead(RelayTrainSide):
    def __init__(self, stages: int) -> None:
        self.stages, self.cpu_group = stages, dist.group.WORLD

    def hex_parts(self) -> int:
        return self.stages

    def hex_part_index(self) -> int | None:
        return dist.get_rank()


def stage_tensors(state: dict, layers: tuple[int, ...], stage: int) -> list:
    """The HF tensors stage ``stage`` holds: its decoder layers, the embedding on the first stage, the final norm
    and head on the last."""

    def home(name: str) -> int:
        held_by = layer_stage(name, layers)
        if held_by is not None:
            return held_by
        return 0 if "embed_tokens" in name else len(layers) - 1

    return [(name, tensor) for name, tensor in state.items() if home(name) == stage]


def _unreachable(*args, **kwargs):
    raise TransportError("no route to the pool from this stage's machine")


def run_stage(
    rank: int, layers: tuple[int, ...], port: int, route: dict, model: str, out: str, cut_off: int
) -> None:
    """Send version 1 of the state dict saved at ``model`` as stage ``rank``; write the outcome (rank 0 also the
    report). ``cut_off``: the stage whose data links cannot be opened (-1: none)."""
    import torch

    os.environ["AREAL_HEX_TRANSPORT_TOKEN"] = "test-token-0123456789abcdef"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(layers))
    if rank == cut_off:
        from areal_hex_plugin.transport import sender

        sender.connect_data_link = _unreachable
    head = StageHead(len(layers))
    head.hex_configure_transport(route, {"backend": "gloo", "timeout_s": 20.0, "chunk_bytes": 64 << 10})
    mine = stage_tensors(torch.load(model), layers, rank)
    try:
        head.hex_begin(1)
        for start in range(0, len(mine), 3):
            head.hex_send(mine[start : start + 3])
        head.hex_finish()
        outcome = {"error": "", "report": head.hex_commit()}
    except Exception as failure:  # noqa: BLE001 - the outcome is what the test checks
        head.hex_abort()
        outcome = {"error": f"{type(failure).__name__}: {failure}", "report": None}
    Path(f"{out}.{rank}").write_text(json.dumps(outcome))
    dist.barrier()
    if head._hex_sender is not None:
        head._hex_sender.close()
    dist.destroy_process_group()


def run_configure(rank: int, world: int, port: int, route: dict, out: str, tokenless: int) -> None:
    """Configure the transport as stage ``rank`` (rank ``tokenless`` without the token); write the outcome."""
    if rank != tokenless:
        os.environ["AREAL_HEX_TRANSPORT_TOKEN"] = "test-token-0123456789abcdef"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    head = StageHead(world)
    try:
        head.hex_configure_transport(route, {"backend": "tcp"})
        outcome = "configured"
    except Exception as failure:  # noqa: BLE001 - the outcome is what the test checks
        outcome = f"{type(failure).__name__}: {failure}"
    Path(f"{out}.{rank}").write_text(outcome)
    dist.barrier()
    dist.destroy_process_group()
