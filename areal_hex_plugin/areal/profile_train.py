"""Measure one GPU type's training speed: upstream's real FSDP PPO actor, built from a recipe, timing
``compute_logp`` and the PPO update (optimizer step included) on random sequences, plus an all-reduce over
its data-parallel group. Used by ``areal-hex profile``."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from areal_hex_plugin.errors import HexError

_FIX = "read the failing rank's traceback above; check actor.path, memory and the recipe's actor settings"
# A collective that has to move at least this much gives a bandwidth figure worth fitting.
_ALLREDUCE_MIB = {"cuda": 256, "cpu": 4}
# Several per clock reading, so the barrier around the clock is a small part of what is timed.
_ALLREDUCES_PER_SAMPLE = 5


def measure_train(
    config: Any,
    *,
    gpus: int,
    sequences: int,
    sequence_tokens: int,
    repeats: int = 3,
    device: str = "cuda",
    timeout_s: float = 3600.0,
) -> dict:
    """Run ``gpus`` ranks of the recipe's FSDP actor on this machine and return rank 0's medians.

    Returns ``{"engine": "fsdp", "gpus", "sequences", "sequence_tokens", "tokens", "gradient_checkpointing",
    "logp_s", "step_s", "allreduce_bus_gb_per_s" (None for one rank), "device_name"}``.
    """
    check_request(config, gpus, sequences, sequence_tokens, repeats)
    _check_device(device, gpus)
    import torch.multiprocessing as mp

    actor_config = dataclasses.replace(config.actor, backend=f"fsdp:d{gpus}")
    with tempfile.TemporaryDirectory(prefix="hex-profile-train-") as folder:
        out = Path(folder) / "result.json"
        job = dict(
            config=actor_config,
            world=gpus,
            port=_free_port(),
            sequences=sequences // gpus,
            sequence_tokens=sequence_tokens,
            repeats=repeats,
            device=device,
            out=str(out),
        )
        context = mp.start_processes(_rank_main, args=(job,), nprocs=gpus, join=False, start_method="spawn")
        _wait(context, timeout_s)
        return json.loads(out.read_text())


def check_request(config: Any, gpus: int, sequences: int, sequence_tokens: int, repeats: int = 3) -> None:
    """Refuse a measurement the recipe's actor cannot run (before any rank starts); fields are the CLI flags."""
    for field, value in (("--train-gpus", gpus), ("--train-sequences", sequences), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise HexError(field, f"{value!r} is not a whole number >= 1", f"pass {field} 1 or more")
    if not isinstance(sequence_tokens, int) or sequence_tokens < 2:
        raise HexError(
            "--train-sequence-tokens", f"{sequence_tokens!r} is too short", "pass at least 2 tokens"
        )
    minibatches = config.actor.ppo_n_minibatches
    if sequences % gpus or sequences // gpus < minibatches:
        raise HexError(
            "--train-sequences",
            f"{sequences} sequences do not split into {gpus} GPUs x {minibatches} minibatches "
            "(actor.ppo_n_minibatches)",
            f"pass a multiple of {gpus} that is at least {gpus * minibatches}",
        )
    limit = config.actor.mb_spec.max_tokens_per_mb
    if limit is not None and sequence_tokens > limit:
        raise HexError(
            "--train-sequence-tokens",
            f"{sequence_tokens} tokens do not fit one micro-batch (actor.mb_spec.max_tokens_per_mb={limit})",
            "pass shorter sequences or raise actor.mb_spec.max_tokens_per_mb",
        )


def _check_device(device: str, gpus: int) -> None:
    if device not in ("cuda", "cpu"):
        raise HexError("device", f"{device!r} is not a device this measures", "use 'cuda' or 'cpu'")
    if device == "cuda":
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < gpus:
            raise HexError(
                "--train-gpus", f"{gpus} CUDA GPUs asked for, {found} visible", "run on a GPU machine"
            )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(context: Any, timeout_s: float) -> None:
    """Join every rank; the first rank to fail (or the deadline) ends the others and becomes a HexError."""
    from torch.multiprocessing.spawn import ProcessException

    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                raise HexError(
                    "train",
                    f"the measurement did not finish within {timeout_s:.0f} s",
                    "fewer repeats or tokens",
                )
    except ProcessException as failure:
        lines = [line for line in str(failure).strip().splitlines() if line.strip()]
        raise HexError(
            "train", f"rank {failure.error_index} failed: {lines[-1] if lines else failure}", _FIX
        ) from failure
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


def _rank_main(rank: int, job: dict) -> None:
    world = job["world"]
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job["port"]),
    )
    if job["device"] == "cpu":
        # Upstream picks its platform (and gloo vs nccl) from what CUDA it can see.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        result = _measure(rank, job)
    except BaseException:
        traceback.print_exc()  # the parent only keeps the last line
        raise
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(result))


def _measure(rank: int, job: dict) -> dict:
    import torch
    import torch.distributed as dist
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPPPOActor
    from areal.utils import stats_tracker

    config, repeats = job["config"], job["repeats"]
    actor = FSDPPPOActor(config)
    actor.create_process_group()
    per_rank, world = job["sequences"], job["world"]
    steps = repeats + 1
    spec = FinetuneSpec(
        total_train_epochs=1, dataset_size=per_rank * world * steps, train_batch_size=per_rank * world
    )
    actor.initialize(None, spec)
    try:
        cuda = actor.device.type == "cuda"

        def clock() -> float:
            if cuda:
                torch.cuda.synchronize()
            dist.barrier(group=actor.cpu_group)
            return time.perf_counter()

        batch = _random_batch(per_rank, job["sequence_tokens"], actor.model_config.vocab_size, seed=rank)
        logp_s, step_s = [], []
        for repeat in range(steps):
            start = clock()
            logps = actor.compute_logp(batch)
            logp_time = clock() - start
            scored = [
                {**trajectory, "prox_logp": logp} for trajectory, logp in zip(batch, logps, strict=True)
            ]
            # Advantages (a GAE loop over tokens) stay outside the timed update: the cost model has no term for them.
            advantaged = actor.compute_advantages(scored)
            start = clock()
            actor.ppo_update(advantaged)
            actor.step_lr_scheduler()
            step_time = clock() - start
            stats_tracker.export(reduce_group=actor.data_parallel_group)
            if repeat:  # the first round is the warm-up
                logp_s.append(logp_time)
                step_s.append(step_time)
        bandwidth = _allreduce_bus_gb_per_s(actor, repeats, clock) if world > 1 else None
        return {
            "engine": "fsdp",
            "gpus": world,
            "sequences": per_rank * world,
            "sequence_tokens": job["sequence_tokens"],
            "tokens": per_rank * world * job["sequence_tokens"],
            "gradient_checkpointing": bool(config.gradient_checkpointing),
            "logp_s": statistics.median(logp_s),
            "step_s": statistics.median(step_s),
            "allreduce_bus_gb_per_s": bandwidth,
            "device_name": torch.cuda.get_device_name(actor.device) if cuda else "cpu",
        }
    finally:
        actor.destroy()


def _random_batch(count: int, tokens: int, vocab: int, seed: int) -> list[dict]:
    """Trajectories shaped like upstream's RLVR workflow output: a short prompt, then a scored response."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompt = max(1, tokens // 8)
    batch = []
    for _ in range(count):
        response = torch.arange(tokens) >= prompt
        trajectory = {
            "input_ids": torch.randint(0, vocab, (tokens,), generator=generator, dtype=torch.int32),
            "loss_mask": response.to(torch.int32),
            "logprobs": -torch.rand(tokens, generator=generator) * response,
            "versions": torch.where(response, 0, -1).to(torch.int32),
            "attention_mask": torch.ones(tokens, dtype=torch.bool),
            "rewards": torch.randint(0, 2, (), generator=generator).float(),
        }
        batch.append({key: value.unsqueeze(0) for key, value in trajectory.items()})
    return batch


def _allreduce_bus_gb_per_s(actor: Any, repeats: int, clock: Any) -> float:
    import torch
    import torch.distributed as dist

    count = _ALLREDUCE_MIB[actor.device.type] * 2**20 // 2
    tensor = torch.zeros(count, dtype=torch.bfloat16, device=actor.device)
    group, n = actor.data_parallel_group, dist.get_world_size(actor.data_parallel_group)
    times = []
    for repeat in range(repeats + 1):
        start = clock()
        for _ in range(_ALLREDUCES_PER_SAMPLE):
            dist.all_reduce(tensor, group=group)
        if repeat:
            times.append((clock() - start) / _ALLREDUCES_PER_SAMPLE)
    return tensor.numel() * tensor.element_size() * 2 * (n - 1) / n / statistics.median(times) / 1e9
