"""Train side inside upstream AReaL: an FSDP PPO actor whose weight update goes through the relay transport, every
rank sending its own share.

Every FSDP rank already gathers every full tensor in upstream's update (``DTensor.full_tensor`` is a collective);
upstream then has rank 0 cast, bucket and broadcast all of them. Here each gathered tensor has one owner rank (the
rank with the fewest elements so far, the same choice on every rank), and each rank casts, buckets
(``weight_chunked_mem_mb``) and sends only what it owns. Why whole gathered tensors and not each rank's local
FSDP shard: the bytes on the cross-pool wire are the same (the model once per pool, about 1/P from each rank), the
gather costs nothing upstream does not already do, and the replicas receive plain HF tensors (no re-assembly of
dim-0 slices, uneven padding or TP placements on the rollout side).
"""

from __future__ import annotations

from areal.engine.fsdp_engine import FSDPPPOActor

from areal_hex_plugin.fast_exit import freeze_heap_at_exit
from areal_hex_plugin.transport.protocol import MAX_PARTS
from areal_hex_plugin.transport.train_side import RelayTrainSide


def sender_stride(world: int) -> int:
    """Every ``sender_stride``-th rank sends a part (all ranks up to MAX_PARTS of them)."""
    return -(-world // MAX_PARTS)


class Owners:
    """Which part owns each tensor: the part with the fewest elements so far (lowest part on a tie)."""

    def __init__(self, parts: int) -> None:
        self.elements = [0] * parts

    def owner(self, numel: int) -> int:
        part = self.elements.index(min(self.elements))
        self.elements[part] += numel
        return part


def fsdp_parts() -> int:
    """How many parts an FSDP version has: one per sending rank."""
    import torch.distributed as dist

    world = dist.get_world_size()
    return -(-world // sender_stride(world))


def fsdp_part_index() -> int | None:
    """The part this FSDP rank sends, None when it sends none."""
    import torch.distributed as dist

    rank, stride = dist.get_rank(), sender_stride(dist.get_world_size())
    return rank // stride if rank % stride == 0 else None


def send_version(engine, side: RelayTrainSide, meta) -> None:
    """Upstream's loop (pause, gather every tensor, resume) on an FSDP ``engine``, each rank sending the tensors it
    owns through ``side`` (the engine itself for :class:`HexFSDPPPOActor`; ``registry.EngineRelay`` for upstream's
    own actor)."""
    import torch.distributed as dist
    from areal.infra.platforms import current_platform

    if engine.config.use_lora:
        raise NotImplementedError("hex.transport=relay sends full weights; LoRA needs hex.transport=upstream")
    side.hex_begin(meta.version if meta.version is not None else engine.get_version() + 1)
    side.hex_on_rank0(engine.rollout_engine.pause_generation, "pause generation")
    mine, owners = side.hex_part_index(), Owners(side.hex_parts())
    limit = meta.weight_chunked_mem_mb << 20
    bucket, size = [], 0
    for name, param in engine._get_model_name_parameters(meta):
        tensor = engine._get_full_tensor(param)  # a collective: every rank gathers every tensor
        if owners.owner(tensor.numel()) != mine:
            continue
        tensor = engine._cast_to_compute_dtype(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            side.hex_send(bucket)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        side.hex_send(bucket)
    dist.barrier(group=engine.cpu_group)
    side.hex_on_rank0(engine.rollout_engine.continue_generation, "resume generation")
    current_platform.synchronize()
    side.hex_finish()


class HexFSDPPPOActor(RelayTrainSide, FSDPPPOActor):
    """Keep ``weight_update_mode: xccl`` in the recipe; the controller configures the route before updates."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        freeze_heap_at_exit()  # upstream's worker then exits within its grace (fast_exit.py)
        self._hex_destroyed = False

    def destroy(self) -> None:
        # Upstream's worker destroys its engines again at SIGTERM after the controller did: that second destroy
        # frees nothing but runs two full collections (1-2 s of the worker's 3 s grace). Once more after a new
        # initialize.
        if self._hex_destroyed and not self.initialized:
            return
        super().destroy()
        self._hex_destroyed = True

    def hex_parts(self) -> int:
        return fsdp_parts()

    def hex_part_index(self) -> int | None:
        return fsdp_part_index()

    # -- upstream seams ----------------------------------------------------------------------------------

    def _init_weight_update_from_distributed(self, meta) -> None:
        # No static NCCL group with every rollout GPU: receivers are reached through the route instead.
        self.weight_update_group_names = []
        self.weight_update_groups = []
        self.weight_update_master_addr = ""
        self.weight_update_master_port = 0

    def _update_weights_from_distributed(self, meta) -> None:
        send_version(self, self, meta)
