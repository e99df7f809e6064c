"""Weight sinks for receivers that are not an inference server: whole tensors, or one replica's TP shards.

``TensorParallelSink`` slices full HF-named tensors the way SGLang's loaders do for Llama/Qwen2-style models
(column-parallel projections and vocabulary rows split on dim 0, row-parallel projections on dim 1, the rest
replicated), so tests can check that receivers with different TP layouts end up with the right pieces.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def shard_dim(name: str) -> int | None:
    """The dim SGLang splits this HF tensor on across TP ranks; None: every rank holds it whole."""
    if any(f"{part}." in name for part in _COLUMN_PARALLEL):
        return 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    return None


class MemorySink:
    """Keeps the committed version's tensors; the swap happens only once all of them are copied."""

    def __init__(self) -> None:
        self.version = -1
        self.tensors: dict[str, torch.Tensor] = {}

    def load(self, version: int, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        tensors = {name: tensor.clone() for name, tensor in named_tensors}
        self.tensors, self.version = tensors, version


class TensorParallelSink:
    """One replica with ``tp_size`` ranks: ``shards[r]`` is rank r's slice of every tensor."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self.version = -1
        self.shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]

    def load(self, version: int, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp_size)]
        for name, tensor in named_tensors:
            dim = shard_dim(name)
            if dim is not None and tensor.shape[dim] % self.tp_size:
                raise ValueError(
                    f"{name}: dim {dim} of {tuple(tensor.shape)} does not split into {self.tp_size}"
                )
            for rank in range(self.tp_size):
                part = tensor if dim is None else tensor.chunk(self.tp_size, dim)[rank]
                shards[rank][name] = part.clone()
        self.shards, self.version = shards, version
